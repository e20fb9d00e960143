"""The numpy reference of llmc::attention against a loop-by-loop statement of its semantics, and as an ONNX Runtime
custom op (CPU only)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from llmc.engines.trt.plugin import attention_reference

RNG = np.random.default_rng(0)


Case = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def case(batch: int, heads: int, kv_heads: int, seq: int, max_seq: int, dim: int, starts: list[int],
         counts: list[int], dtype: type = np.float32) -> Case:
    """Right-padded rows: row b has starts[b] cached tokens and counts[b] new ones (pads: position 0)."""
    def draw(*shape: int) -> np.ndarray:
        return RNG.standard_normal(shape).astype(dtype)

    q, k_new, v_new = draw(batch, heads, seq, dim), draw(batch, kv_heads, seq, dim), draw(batch, kv_heads, seq, dim)
    past_k, past_v = draw(batch, kv_heads, max_seq, dim), draw(batch, kv_heads, max_seq, dim)
    pos = np.zeros((batch, seq), np.int64)
    for b in range(batch):
        pos[b, : counts[b]] = starts[b] + np.arange(counts[b])
    return q, k_new, v_new, past_k, past_v, pos


def naive(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, past_k: np.ndarray, past_v: np.ndarray,
          pos: np.ndarray, scale: float, window: int = 0, softcap: float = 0.0) -> tuple[np.ndarray, ...]:
    batch, heads, seq, dim = q.shape
    groups = heads // k_new.shape[1]
    pk, pv = past_k.astype(np.float64), past_v.astype(np.float64)
    for b in range(batch):
        for j in range(seq):
            pk[b, :, pos[b, 0] + j], pv[b, :, pos[b, 0] + j] = k_new[b, :, j], v_new[b, :, j]
    out = np.zeros(q.shape)
    for b in range(batch):
        for h in range(heads):
            for s in range(seq):
                keys = range(max(0, int(pos[b, s]) - window + 1) if window else 0, int(pos[b, s]) + 1)
                scores = np.array([q[b, h, s] @ pk[b, h // groups, t] * scale for t in keys])
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                w = np.exp(scores - scores.max())
                out[b, h, s] = (w / w.sum()) @ pv[b, h // groups, list(keys)]
    return out, pk, pv


@pytest.mark.parametrize("shape", [
    dict(batch=3, heads=4, kv_heads=2, seq=5, max_seq=16, dim=8, starts=[0, 0, 0], counts=[5, 2, 3]),  # prefill
    dict(batch=3, heads=6, kv_heads=2, seq=1, max_seq=16, dim=8, starts=[4, 9, 0], counts=[1, 1, 1]),  # decode
    dict(batch=2, heads=4, kv_heads=4, seq=3, max_seq=12, dim=4, starts=[5, 2], counts=[3, 3]),  # chunk, MHA
])
def test_reference_matches_the_loop_statement(shape: dict) -> None:
    args = case(**shape)
    out, pk, pv = attention_reference(*args, 0.3)
    ref_out, ref_k, ref_v = naive(*args, 0.3)
    counts = shape["counts"]
    for b, n in enumerate(counts):  # pad queries are garbage by contract; real ones must match
        assert np.abs(out[b, :, :n] - ref_out[b, :, :n]).max() < 1e-5
    assert np.allclose(pk, ref_k) and np.allclose(pv, ref_v)
    assert not np.shares_memory(pk, args[3])  # the reference returns updated copies; engines alias them


@pytest.mark.parametrize(("window", "softcap"), [(3, 0.0), (0, 0.8), (2, 1.5)])
def test_reference_window_and_softcap_match_the_loop_statement(window: int, softcap: float) -> None:
    args = case(3, 4, 2, 4, 16, 8, [0, 6, 9], [4, 2, 4])  # prompt, chunk after 6 (with pads), chunk after 9
    out = attention_reference(*args, 0.7, window=window, softcap=softcap)[0]
    ref = naive(*args, 0.7, window=window, softcap=softcap)[0]
    plain = attention_reference(*args, 0.7)[0]
    for b, n in enumerate([4, 2, 4]):
        assert np.abs(out[b, :, :n] - ref[b, :, :n]).max() < 1e-5
    assert np.abs(out - plain).max() > 1e-2  # the window / softcap changes the answer


def test_reference_in_fp16_keeps_dtype() -> None:
    args = case(2, 4, 2, 3, 8, 8, [0, 2], [3, 3], dtype=np.float16)
    out, pk, _ = attention_reference(*args, 0.25)
    assert out.dtype == np.float16 and pk.dtype == np.float16


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (3, 0.7)])
def test_ort_custom_op_runs_the_reference(window: int, softcap: float) -> None:
    """The node's window (int) and softcap (float) attributes, as trt_lower writes them, reach the reference."""
    import onnxruntime as ort

    from llmc.engines.trt.plugin import register_ort_reference

    args = case(2, 4, 2, 3, 8, 8, [0, 4], [3, 1])
    names = ["q", "k_new", "v_new", "past_key", "past_value", "position_ids"]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n == "position_ids" else TensorProto.FLOAT,
                                            list(a.shape)) for n, a in zip(names, args)]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "pk", "pv")]
    node = helper.make_node("attention", names, ["out", "pk", "pv"], domain="llmc", num_heads=4, kv_num_heads=2,
                            head_dim=8, scale=0.5, block_m=16, window=window, softcap=softcap,
                            plugin_namespace="llmc", aot=1)
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("llmc", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(register_ort_reference())
    got = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, dict(zip(names, args)))
    want = attention_reference(*args, 0.5, window=window, softcap=softcap)
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.abs(g - w).max() < 1e-6
    if window:
        assert np.abs(got[0] - attention_reference(*args, 0.5)[0]).max() > 1e-2  # the attributes were used
