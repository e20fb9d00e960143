"""llmc's residual norm (ai.llmc.SkipRMSNorm): RMSNorm(x + skip) * gamma and the sum, against numpy and against
ONNX Runtime's SkipSimplifiedLayerNormalization (what it replaces in llmc's fp32 engines), on its AVX-512 and
portable paths, for decode's few rows (the calling thread) and a prompt's (the pool's threads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

RNG = np.random.default_rng(11)
PATHS = {"native": {}, "portable": {"LLMC_KERNELS_GENERIC": "1"}}


def _session(library: Path | None, d: int, gamma: np.ndarray, eps: float, threads: int, with_sum: bool = True,
             ort_op: bool = False) -> object:
    import onnxruntime as ort

    if ort_op:
        node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y", "", "", "sum"],
                                domain="com.microsoft", epsilon=eps)
    else:
        node = helper.make_node("SkipRMSNorm", ["x", "skip", "gamma"], ["y", "sum" if with_sum else ""],
                                domain="ai.llmc", epsilon=eps)
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if with_sum:
        outputs.append(helper.make_tensor_value_info("sum", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "S", d]) for n in ("x", "skip")]
    graph = helper.make_graph([node], "norm", inputs, outputs, initializer=[numpy_helper.from_array(gamma, "gamma")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "d"), [(1, 576), (3, 64), (100, 576), (70, 40), (1, 1)])
def test_norm_matches_numpy_and_onnx_runtime(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str,
                                             threads: int, rows: int, d: int) -> None:
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    x, skip = (RNG.standard_normal((1, rows, d)).astype(np.float32) * 3 for _ in range(2))
    gamma = RNG.standard_normal(d).astype(np.float32)
    y, total = _session(llmc_ops, d, gamma, 1e-5, threads).run(None, {"x": x, "skip": skip})
    s = x.astype(np.float64) + skip
    expected = s / np.sqrt((s ** 2).mean(-1, keepdims=True) + 1e-5) * gamma
    np.testing.assert_array_equal(total, x + skip)  # the residual stream exactly
    np.testing.assert_allclose(y, expected, rtol=2e-6, atol=2e-6 * np.abs(expected).max())
    theirs = _session(None, d, gamma, 1e-5, threads, ort_op=True).run(None, {"x": x, "skip": skip})
    np.testing.assert_allclose(y, theirs[0], rtol=2e-6, atol=2e-6 * np.abs(expected).max())


def test_the_sum_is_optional_and_zero_rows_are_zero(llmc_ops: Path) -> None:
    gamma = np.ones(32, np.float32)
    x = np.zeros((1, 2, 32), np.float32)
    (y,) = _session(llmc_ops, 32, gamma, 1e-6, 1, with_sum=False).run(None, {"x": x, "skip": x})
    np.testing.assert_array_equal(y, 0)  # 0 / sqrt(eps): no NaN


def test_mismatched_shapes_are_named(llmc_ops: Path) -> None:
    sess = _session(llmc_ops, 16, np.ones(16, np.float32), 1e-5, 1)
    with pytest.raises(Exception, match=r"SkipRMSNorm: expected input and skip of one shape \[\.\.\., D\] and gamma"):
        sess.run(None, {"x": np.zeros((1, 2, 16), np.float32), "skip": np.zeros((1, 3, 16), np.float32)})
