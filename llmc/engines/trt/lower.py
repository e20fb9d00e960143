"""Lower the in-place "onnx"-attention graphs for TensorRT: per layer, the TensorScatter x2 + Slice x2 + Attention
subgraph written by `llmc.graph.decoder._OnnxAttention` becomes ONE `llmc::attention` plugin node that attends over
the cache and writes the new K/V into it in place.

Plugin node: op_type "attention", domain "llmc" (ONNX Runtime finds the reference custom op by domain, TensorRT's
parser finds the plugin by op type plus the `plugin_namespace` attribute; `aot` asks for the ahead-of-time kernel).
  inputs   q [B, H, S, D], k_new, v_new [B, Hkv, S, D], past_key, past_value [B, Hkv, max_seq, D], position_ids [B, S]
  outputs  attn [B, H, S, D], present_key, present_value (the past buffers, written in place)
  attrs    num_heads, kv_num_heads, head_dim, scale, block_m (query rows per kernel tile), window (the layer's
           sliding window W, 0: full attention), softcap (c of c * tanh(score / c), 0.0: none), in this order (the
           plugin's schema, trt_plugin.register_trt_plugin)
scale is the Attention node's `scale` (ONNX's default 1 / sqrt(head_dim) without one), softcap its `softcap` (else
the model's attn_softcap); the window is the model's for the block's layer (ModelSpec.window): the mask that carried
it is not kept. The mask, write index and key-length nodes that fed the replaced subgraph are left without consumers
and removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper

from llmc.errors import LlmcError
from llmc.graph import io_names as io
from llmc.manifest import ModelSpec
from llmc.onnx_store import load_graph

PLUGIN_NAMESPACE = "llmc"
PLUGIN_NAME = "attention"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
# The same attention over a paged KV cache (pools [num_blocks, Hkv, block_size, D] read and written through a
# block table, llmc.engines.trt.plugin.register_trt_plugin); no lowering writes it yet (the engine binds slots).
PAGED_PLUGIN_NAME = "paged_attention"
PAGED_PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PAGED_PLUGIN_NAME}"
BLOCK_M = {"prefill": 64, "decode": 16}  # decode: one tile holds the G query heads of one KV head


@dataclass(frozen=True)
class AttentionBlock:
    """One layer's matched subgraph (node protos of the graph being lowered)."""

    attention: onnx.NodeProto
    scatters: tuple[onnx.NodeProto, onnx.NodeProto]  # K, V: TensorScatter(past, new, write_index) -> present
    slices: tuple[onnx.NodeProto, onnx.NodeProto]  # K, V: Slice(present, 0, T, axis 2)


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output}


def _attr(node: onnx.NodeProto, name: str) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def _scatter_slice(producers: dict[str, onnx.NodeProto], value: str) -> tuple[onnx.NodeProto, onnx.NodeProto] | None:
    sl = producers.get(value)
    if sl is None or sl.op_type != "Slice":
        return None
    sc = producers.get(sl.input[0])
    if sc is None or sc.op_type != "TensorScatter" or _attr(sc, "axis") not in (2, -2):
        return None
    return sc, sl


def find_attention_blocks(graph: onnx.GraphProto) -> list[AttentionBlock]:
    """Every Attention node whose K and V are slices of TensorScatter writes into the bound cache."""
    producers = _producers(graph)
    inputs = {i.name for i in graph.input}
    blocks = []
    for node in graph.node:
        if node.op_type != "Attention" or len(node.input) < 3:
            continue
        k, v = _scatter_slice(producers, node.input[1]), _scatter_slice(producers, node.input[2])
        if k is None or v is None or k[0].input[0] not in inputs or v[0].input[0] not in inputs:
            continue
        blocks.append(AttentionBlock(node, (k[0], v[0]), (k[1], v[1])))
    return blocks


def plugin_node(block: AttentionBlock, model: ModelSpec, graph: str, name: str, layer: int) -> onnx.NodeProto:
    """The plugin node replacing `block`, layer `layer`'s attention."""
    (k_scatter, v_scatter), q = block.scatters, block.attention.input[0]
    scale, softcap = _attr(block.attention, "scale"), _attr(block.attention, "softcap")
    assert scale is None or isinstance(scale, float)
    assert softcap is None or isinstance(softcap, float)
    return helper.make_node(
        PLUGIN_NAME,
        [q, k_scatter.input[1], v_scatter.input[1], k_scatter.input[0], v_scatter.input[0], io.POSITION_IDS],
        [block.attention.output[0], k_scatter.output[0], v_scatter.output[0]],
        name=name, domain=PLUGIN_NAMESPACE, plugin_namespace=PLUGIN_NAMESPACE, aot=1,
        num_heads=model.num_heads, kv_num_heads=model.num_kv_heads, head_dim=model.head_dim,
        scale=float(scale) if scale is not None else model.head_dim ** -0.5, block_m=BLOCK_M[graph],
        window=int(model.window(layer)), softcap=float(softcap if softcap is not None else model.attn_softcap),
    )


def _set_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    copies = []
    for node in nodes:  # copied first: clearing the field may invalidate views into it
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copies.append(copy)
    graph.ClearField("node")
    graph.node.extend(copies)


def prune_dead_nodes(graph: onnx.GraphProto) -> int:
    """Drop nodes (and initializers) nothing reaches the graph outputs through; returns how many nodes went."""
    live = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(out in live for out in node.output):
            keep.append(node)
            live.update(i for i in node.input if i)
    dropped = len(graph.node) - len(keep)
    _set_nodes(graph, keep[::-1])
    dead = [i for i, t in enumerate(graph.initializer) if t.name not in live]
    for i in reversed(dead):
        del graph.initializer[i]
    return dropped


def lower_graph(graph: onnx.GraphProto, model: ModelSpec, name: str) -> int:
    """Replace every layer's attention subgraph in place; returns the number of plugin nodes."""
    if io.POSITION_IDS not in {i.name for i in graph.input}:
        raise LlmcError(f"{name} graph has no {io.POSITION_IDS} input: only in-place 'onnx'-attention graphs lower")
    blocks = find_attention_blocks(graph)
    if len(blocks) != model.num_layers:
        raise LlmcError(f"{name} graph: found {len(blocks)} TensorScatter + Attention blocks, expected one per layer "
                        f"({model.num_layers}); is it an in-place 'onnx'-attention graph?")
    replaced = {n.name for b in blocks for n in (b.attention, *b.scatters, *b.slices)}
    if "" in replaced or len(replaced) != 5 * len(blocks):
        raise LlmcError(f"{name} graph: the attention nodes need unique names to be lowered")
    for i, b in enumerate(blocks):  # layer order: each layer's window is its own
        if b.scatters[0].input[0] != io.PAST_KEY.format(i=i):
            raise LlmcError(f"{name} graph: attention block {i} writes {b.scatters[0].input[0]}, not "
                            f"{io.PAST_KEY.format(i=i)}: the blocks are not in layer order")
    plugins = {b.attention.name: plugin_node(b, model, name, f"llmc_attention_{i}", i) for i, b in enumerate(blocks)}
    _set_nodes(graph, [plugins.get(n.name, n) for n in graph.node if n.name not in replaced or n.name in plugins])
    prune_dead_nodes(graph)
    return len(blocks)


def lower_file(path: Path, model: ModelSpec, name: str) -> int:
    """Lower one graph file in place (its external weights stay where they are)."""
    proto = load_graph(path)
    count = lower_graph(proto.graph, model, name)
    if not any(o.domain == PLUGIN_NAMESPACE for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(PLUGIN_NAMESPACE, 1))
    onnx.save(proto, str(path))
    return count
