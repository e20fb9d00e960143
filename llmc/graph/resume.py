"""A calibration graph that resumes at a block: every decoder block but the last becomes an If on
CALIBRATE_START, which either computes the block or hands on what the block would hand on, fed from an earlier run.

The precision search (engines/ort/quality.py) scores one run per candidate layer with only that layer at low
precision. Every block before that layer's computes exactly what the all-exact reference run computed, so the
reference run returns each block's outgoing values (the residual stream, and whatever else a later block reads:
rotary tables, masks, a shared KV cache) as outputs, and each later run starts at its layer's block with them fed as
inputs. A run then costs the blocks from its own on, about half the model on average.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CALIBRATE_START = "calibrate.start"  # int64 scalar: the first block a run computes (the earlier ones' outputs fed)
RESUME_PREFIX = "calibrate.resume."  # + a value's name: the input a skipped block hands on as that value

_BOOL_OPS = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN",
             "IsInf"}
_INT64_OPS = {"Shape", "Size", "NonZero", "ArgMax", "ArgMin"}
_OTHER_OUTPUTS = {"TopK": (TensorProto.INT64,), "DynamicQuantizeLinear": (TensorProto.FLOAT, TensorProto.UINT8),
                  "Unique": (TensorProto.INT64,) * 3}


class NotResumable(ValueError):
    """A block hands on a value whose element type this module cannot tell (the graph then runs whole)."""


def resumable(graph: onnx.GraphProto, starts: list[int], weights: dict[str, int]) -> list[str]:
    """Wrap graph's blocks (block i = graph.node[starts[i]:starts[i + 1]], the last one to the end of its nodes
    excluded: it always runs) in place; returns the names of the values the blocks hand on, which are added as graph
    outputs (for the reference run to return) and, prefixed with RESUME_PREFIX, as inputs (each later run's).
    `weights`: the element types of the weights the graph reads that are not (yet) its initializers or inputs."""
    nodes = list(graph.node)
    dtypes = value_dtypes(graph, weights)
    outputs = {o.name for o in graph.output}
    last_use: dict[str, int] = {}
    for k, node in enumerate(nodes):
        for name in uses(node):
            last_use[name] = k
    wrapped: list[onnx.NodeProto] = list(nodes[:starts[0]])
    handed: list[str] = []
    for i in range(len(starts) - 1):
        block = nodes[starts[i]:starts[i + 1]]
        made = [o for n in block for o in n.output if o]
        carried = [v for v in made if last_use.get(v, -1) >= starts[i + 1] or v in outputs]
        missing = [v for v in carried if v not in dtypes]
        if missing:
            raise NotResumable(f"block {i} hands on {missing[0]!r}, of an element type not known here")
        wrapped += _wrap(i, block, carried, dtypes)
        handed += carried
    wrapped += nodes[starts[-1]:]
    del graph.node[:]
    graph.node.extend(wrapped)
    graph.input.append(helper.make_tensor_value_info(CALIBRATE_START, TensorProto.INT64, []))
    graph.input.extend(helper.make_tensor_value_info(RESUME_PREFIX + v, dtypes[v], None) for v in handed)
    graph.output.extend(helper.make_tensor_value_info(v, dtypes[v], None) for v in handed if v not in outputs)
    return handed


def _wrap(i: int, block: list[onnx.NodeProto], carried: list[str],
          dtypes: dict[str, int]) -> list[onnx.NodeProto]:
    """Block i as If(i < start): then the fed values, else the block itself, its carried values renamed inside."""
    inside = {v: f"{v}.block{i}" for v in carried}
    body = [_renamed(n, inside) for n in block]
    run = helper.make_graph(body, f"block{i}.run", [],
                            [helper.make_tensor_value_info(inside[v], dtypes[v], None) for v in carried])
    fed = [helper.make_node("Identity", [RESUME_PREFIX + v], [f"{v}.fed{i}"], name=f"block{i}.fed.{k}")
           for k, v in enumerate(carried)]
    skip = helper.make_graph(fed, f"block{i}.skip", [],
                             [helper.make_tensor_value_info(f"{v}.fed{i}", dtypes[v], None) for v in carried])
    index = helper.make_node("Constant", [], [f"block{i}.index"], name=f"block{i}.index",
                             value=numpy_helper.from_array(np.array(i, np.int64)))
    skipped = helper.make_node("Less", [f"block{i}.index", CALIBRATE_START], [f"block{i}.skipped"],
                               name=f"block{i}.skipped")
    branch = helper.make_node("If", [f"block{i}.skipped"], carried, name=f"block{i}", then_branch=skip,
                              else_branch=run)
    return [index, skipped, branch]


def _renamed(node: onnx.NodeProto, names: dict[str, str]) -> onnx.NodeProto:
    """node with every reference to a key of names (its inputs, its outputs, its subgraphs' uses) renamed."""
    out = onnx.NodeProto()
    out.CopyFrom(node)
    _rename_in(out, names)
    return out


def _rename_in(node: onnx.NodeProto, names: dict[str, str]) -> None:
    for k, v in enumerate(node.input):
        node.input[k] = names.get(v, v)
    for k, v in enumerate(node.output):
        node.output[k] = names.get(v, v)
    for attr in node.attribute:
        for g in _subgraphs(attr):
            for n in g.node:
                _rename_in(n, names)
            for o in g.output:
                o.name = names.get(o.name, o.name)


def _subgraphs(attr: onnx.AttributeProto) -> Iterable[onnx.GraphProto]:
    if attr.type == onnx.AttributeProto.GRAPH:
        yield attr.g
    elif attr.type == onnx.AttributeProto.GRAPHS:
        yield from attr.graphs


def uses(node: onnx.NodeProto) -> set[str]:
    """The values node reads: its inputs and those its subgraphs read from outside them."""
    used = {v for v in node.input if v}
    for attr in node.attribute:
        for g in _subgraphs(attr):
            made = {i.name for i in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                used |= uses(n) - made
                made.update(n.output)
            used |= {o.name for o in g.output} - made
    return used


def value_dtypes(graph: onnx.GraphProto, known: dict[str, int] | None = None) -> dict[str, int]:
    """Each value's element type, from the graph's inputs and initializers forward: a comparison's is bool, a
    Cast's its `to`, a Constant's its tensor's, an If's or a Loop's as their subgraph declares; every other op (llmc's and ONNX Runtime's
    contrib ops among them) gives its outputs the type of its first input (Where: its second), but for the few
    whose later outputs differ (_OTHER_OUTPUTS)."""
    types = {**(known or {}), **{v.name: v.type.tensor_type.elem_type for v in graph.input}}
    types.update((t.name, t.data_type) for t in graph.initializer)
    for node in graph.node:
        if not node.output or not node.output[0]:
            continue
        attrs = {a.name: a for a in node.attribute}
        kind: int | None
        if node.op_type == "DynamicQuantizeLinear":
            kind = TensorProto.UINT8
        elif node.op_type in _BOOL_OPS:
            kind = TensorProto.BOOL
        elif node.op_type in _INT64_OPS:
            kind = TensorProto.INT64
        elif node.op_type == "Cast":
            kind = attrs["to"].i
        elif node.op_type == "Constant":
            kind = attrs["value"].t.data_type if "value" in attrs else None
        elif node.op_type == "ConstantOfShape":
            kind = attrs["value"].t.data_type if "value" in attrs else TensorProto.FLOAT
        elif node.op_type in ("If", "Loop"):  # (each output as its branch's or body's; a Loop's body first
            # returns its condition)
            body = attrs["then_branch" if node.op_type == "If" else "body"].g.output[node.op_type == "Loop":]
            types.update((o, b.type.tensor_type.elem_type) for o, b in zip(node.output, body, strict=False)
                         if o and b.type.tensor_type.elem_type)
            continue
        else:
            source = node.input[1] if node.op_type == "Where" else (node.input[0] if node.input else "")
            kind = types.get(source)
        if kind:
            types.update((o, kind) for o in node.output if o)
        if node.op_type in _OTHER_OUTPUTS:
            types.update((o, t) for o, t in zip(node.output[1:], _OTHER_OUTPUTS[node.op_type], strict=False) if o)
    return types
