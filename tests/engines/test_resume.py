"""A calibration graph's blocks as Ifs on where a run starts (llmc/graph/resume.py), on a hand-made graph of three
blocks: the values each hands on, the runs that start later, and the element types it needs to know."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmc.graph.resume import CALIBRATE_START, RESUME_PREFIX, NotResumable, resumable, value_dtypes


def _graph() -> tuple[onnx.GraphProto, list[int]]:
    """Block 0 makes a = 2x + 1, t = cos x and (an If of its own reading a) a_if = a; block 1 c = (a_if + t) a; block
    2 (the last) y = c + t. x -> 2x is the prefix, before block 0."""
    one = helper.make_node("Constant", [], ["one_b"], value=numpy_helper.from_array(np.array(1.0, np.float32)))
    inner = helper.make_graph([helper.make_node("Mul", ["a", "one_b"], ["a_twice"])], "inner", [],
                              [helper.make_tensor_value_info("a_twice", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Mul", ["x", "two"], ["p"]),  # the prefix (before block 0)
             helper.make_node("Add", ["p", "one"], ["a"]),  # block 0
             helper.make_node("Cos", ["x"], ["t"]),
             one, helper.make_node("Greater", ["one_b", "zero"], ["yes"]),
             helper.make_node("If", ["yes"], ["a_if"], then_branch=inner, else_branch=inner),
             helper.make_node("Add", ["a_if", "t"], ["b"]),  # block 1
             helper.make_node("Mul", ["b", "a"], ["c"]),
             helper.make_node("Add", ["c", "t"], ["y"])]  # block 2
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("two", 2.0), ("one", 1.0),
                                                                                ("zero", 0.0))]
    graph = helper.make_graph(nodes, "three", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], initializer=consts)
    return graph, [1, 6, 8]


def _typed_outputs(*types: int) -> onnx.GraphProto:
    """A subgraph declaring outputs of these element types (its nodes do not matter to value_dtypes)."""
    return helper.make_graph([], "body", [], [helper.make_tensor_value_info(f"o{k}", t, None)
                                              for k, t in enumerate(types)])


def _session(graph: onnx.GraphProto) -> ort.InferenceSession:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_each_block_but_the_last_hands_on_what_later_blocks_read() -> None:
    graph, starts = _graph()
    handed = resumable(graph, starts, {})
    assert handed == ["a", "t", "a_if", "c"]  # block 0: what block 1 reads and what block 2 does; block 1: c
    assert [n.op_type for n in graph.node] == ["Mul", "Constant", "Less", "If", "Constant", "Less", "If", "Add"]
    inputs = {i.name for i in graph.input}
    assert {CALIBRATE_START, *(RESUME_PREFIX + v for v in handed)} <= inputs
    assert set(handed) <= {o.name for o in graph.output}


def test_a_run_that_starts_later_computes_the_same_from_what_it_is_fed() -> None:
    plain, starts = _graph()
    x = np.array([0.5, -1.0, 2.0, 3.0], np.float32)
    want = _session(plain).run(["y"], {"x": x})[0]
    graph, _ = _graph()
    handed = resumable(graph, starts, {})
    session = _session(graph)
    empty = {RESUME_PREFIX + v: np.zeros(0, np.float32) for v in handed}
    y, *outs = session.run(["y", *handed], {"x": x, CALIBRATE_START: np.array(0, np.int64), **empty})
    np.testing.assert_array_equal(y, want)  # (block 0 first: nothing fed is read)
    fed = {RESUME_PREFIX + v: a for v, a in zip(handed, outs, strict=True)}
    for start in (1, 2):
        np.testing.assert_array_equal(session.run(["y"], {"x": x, CALIBRATE_START: np.array(start, np.int64),
                                                          **fed})[0], want)
    # what a skipped block hands on is what it is fed: a wrong value fed changes y only where a block that runs
    # reads it from a skipped one
    # (a: block 0 skipped and block 1 run; t: block 0 skipped, blocks 1 and 2 read it; c: block 1 skipped)
    for value, read in (("a", {1}), ("t", {1, 2}), ("c", {2})):
        wrong = {**fed, RESUME_PREFIX + value: fed[RESUME_PREFIX + value] + 1}
        for start in (0, 1, 2):
            y = session.run(["y"], {"x": x, CALIBRATE_START: np.array(start, np.int64), **wrong})[0]
            assert np.array_equal(y, want) == (start not in read), (value, start)


def test_element_types_follow_the_ops_and_unknown_ones_stop_the_wrapping() -> None:
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Less", ["x", "x"], ["lt"]),
             helper.make_node("Cast", ["lt"], ["lt16"], to=TensorProto.FLOAT16),
             helper.make_node("TopK", ["x", "k"], ["top", "idx"]), helper.make_node("Where", ["lt", "w", "x"], ["wh"]),
             helper.make_node("MatMulQ4", ["x", "w"], ["q"], domain="ai.llmc"),
             helper.make_node("Add", ["unseen", "x"], ["u"]),
             helper.make_node("If", ["lt"], ["i_f", "i_b"], then_branch=_typed_outputs(TensorProto.FLOAT16,
                                                                                      TensorProto.BOOL)),
             helper.make_node("Loop", ["k", "lt"], ["l_carried"], body=_typed_outputs(TensorProto.BOOL,
                                                                                     TensorProto.INT32))]
    graph = helper.make_graph(nodes, "types", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])], [],
                              initializer=[numpy_helper.from_array(np.array([2], np.int64), "k")])
    types = value_dtypes(graph, {"w": TensorProto.FLOAT})
    assert (types["s"], types["lt"], types["lt16"]) == (TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT16)
    assert (types["top"], types["idx"], types["wh"], types["q"]) == (TensorProto.FLOAT, TensorProto.INT64,
                                                                      TensorProto.FLOAT, TensorProto.FLOAT)
    assert "u" not in types  # (its first input's type is not known: a graph input not declared, a weight not given)
    assert (types["i_f"], types["i_b"], types["l_carried"]) == (TensorProto.FLOAT16, TensorProto.BOOL,
                                                                 TensorProto.INT32)
    plain, starts = _graph()
    del plain.input[:]  # x's type now unknown: nothing block 0 makes from it can be typed
    with pytest.raises(NotResumable, match="block 0 hands on 'a'"):
        resumable(plain, starts, {})
