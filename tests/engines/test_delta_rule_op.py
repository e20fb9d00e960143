"""llmc's gated delta rule (ai.llmc.GatedDeltaRule, Qwen3.5's Gated DeltaNet recurrence) against a float64 numpy
reference of transformers' recurrent form, on its AVX-512, AVX2 and portable paths, one and two threads, value heads
sharing key heads, one-token decode steps and a prompt's run; a padded token (g = beta = 0) leaves the state. Its
`delta` 0 (Mamba-2's state-space recurrence, no delta correction) against the same reference without it; a decay
per key dim (Kimi Delta Attention's g [B, S, H, K]) on both; Mamba-1's selective scan (the optional input A: a decay
per channel and state element, g = beta = dt one a channel) against transformers' mamba_selective_state_update."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

RNG = np.random.default_rng(5)
PATHS = {"native": {}, "avx2": {"LLMC_KERNELS_AVX2": "1"}, "portable": {"LLMC_KERNELS_GENERIC": "1"}}
NAMES = ("q", "k", "v", "g", "beta", "state")


def _session(library: Path, threads: int, pooled: bool = False, delta: int | None = None,
             scan: bool = False) -> object:
    import onnxruntime as ort

    names = [*NAMES, "state_rows"] if pooled else list(NAMES)
    if scan:
        names = [*names, *([] if pooled else [""]), "A"]
    node = helper.make_node("GatedDeltaRule", names, ["out", "state_out"], domain="ai.llmc",
                            **({} if delta is None else {"delta": delta}))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "state_rows" else TensorProto.FLOAT, None)
              for n in names if n]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "state_out")]
    model = helper.make_model(helper.make_graph([node], "delta_rule", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
               state: np.ndarray, delta: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """transformers' torch_recurrent_gated_delta_rule after its norms, in float64; without the delta,
    mamba2_selective_state_update's (the state transposed: [K = d_state, V = head_dim])."""
    b, s, hk, _ = q.shape
    h = v.shape[2]
    m = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for t in range(s):
        for head in range(h):
            kh = head // (h // hk)
            qt, kt, vt = q[:, t, kh].astype(np.float64), k[:, t, kh].astype(np.float64), v[:, t, head]
            decay = np.exp(g[:, t, head])  # [B], or [B, K]: one a row of M (Kimi's)
            m[:, head] *= decay[:, :, None] if decay.ndim == 2 else decay[:, None, None]
            mem = np.einsum("bkv,bk->bv", m[:, head], kt) if delta else 0.0
            u = (vt - mem) * beta[:, t, head][:, None]
            m[:, head] += kt[:, :, None] * u[:, None, :]
            out[:, t, head] = np.einsum("bkv,bk->bv", m[:, head], qt)
    return out, m


def _inputs(b: int, s: int, hk: int, h: int, kd: int, vd: int) -> dict[str, np.ndarray]:
    def unit(x: np.ndarray) -> np.ndarray:
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    return {"q": unit(RNG.standard_normal((b, s, hk, kd))) * np.float32(kd ** -0.5),
            "k": unit(RNG.standard_normal((b, s, hk, kd))),
            "v": RNG.standard_normal((b, s, h, vd)).astype(np.float32),
            "g": -np.abs(RNG.standard_normal((b, s, h))).astype(np.float32),
            "beta": RNG.uniform(0, 1, (b, s, h)).astype(np.float32),
            "state": RNG.standard_normal((b, h, kd, vd)).astype(np.float32)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(2, 1, 2, 4, 16, 8), (1, 37, 1, 2, 32, 32), (3, 5, 4, 4, 128, 128),
                                   (2, 3, 2, 2, 8, 12), (1, 2, 1, 1, 16, 48), (2, 1, 2, 4, 64, 128)])
def test_the_rule_matches_its_reference(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str, threads: int,
                                        shape: tuple[int, ...]) -> None:
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    feeds = _inputs(*shape)
    out, state = _session(llmc_ops, threads).run(None, feeds)
    ref_out, ref_state = _reference(*(feeds[n] for n in NAMES))
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4 * np.abs(ref_out).max())
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=1e-4 * np.abs(ref_state).max())


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(2, 1, 1, 4, 16, 8), (1, 37, 2, 4, 128, 64), (3, 5, 1, 2, 32, 144),
                                   (2, 3, 2, 2, 8, 12)])
def test_without_the_delta_the_state_space_recurrence(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str,
                                                      threads: int, shape: tuple[int, ...]) -> None:
    """delta 0: M <- M exp(g) + k^T (beta v) (Mamba-2: k = B, q = C, v = x, beta = dt; B and C unnormed, wide)."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    feeds = _inputs(*shape)
    feeds["q"], feeds["k"] = (RNG.standard_normal(feeds[n].shape).astype(np.float32) for n in ("q", "k"))
    out, state = _session(llmc_ops, threads, delta=0).run(None, feeds)
    ref_out, ref_state = _reference(*(feeds[n] for n in NAMES), delta=False)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4 * np.abs(ref_out).max())
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=1e-4 * np.abs(ref_state).max())
    with_delta, _ = _reference(*(feeds[n] for n in NAMES))
    assert np.abs(with_delta - ref_out).max() > 0.01 * np.abs(ref_out).max()  # (the two rules part here)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("delta", [1, 0])
@pytest.mark.parametrize("shape", [(2, 1, 2, 2, 16, 16), (1, 9, 2, 2, 128, 128), (2, 4, 1, 3, 32, 24)])
def test_a_decay_per_key_dim(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str, threads: int, delta: int,
                             shape: tuple[int, ...]) -> None:
    """g [B, S, H, K] (Kimi Delta Attention): row i of each head's state decays by exp(g[.., i])."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    feeds = _inputs(*shape)
    b, s, _, h, kd, _ = shape
    feeds["g"] = -np.abs(RNG.standard_normal((b, s, h, kd))).astype(np.float32)
    out, state = _session(llmc_ops, threads, delta=delta).run(None, feeds)
    ref_out, ref_state = _reference(*(feeds[n] for n in NAMES), delta=bool(delta))
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4 * np.abs(ref_out).max())
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=1e-4 * np.abs(ref_state).max())
    per_head = _reference(*(feeds[n] for n in NAMES[:3]), feeds["g"].mean(-1), *(feeds[n] for n in NAMES[4:]),
                          delta=bool(delta))[1]
    assert np.abs(per_head - ref_state).max() > 0.01 * np.abs(ref_state).max()  # (the per-row decays matter)


def test_a_padded_token_leaves_the_state(llmc_ops: Path) -> None:
    feeds = _inputs(2, 4, 2, 4, 16, 16)
    feeds["g"][1, 2:], feeds["beta"][1, 2:] = 0, 0  # row 1 has 2 tokens, right-padded to 4
    _, state = _session(llmc_ops, 2).run(None, feeds)
    _, alone = _session(llmc_ops, 1).run(None, {n: a[1:2, :2] if a.ndim > 2 and n != "state" else a[1:2]
                                                for n, a in feeds.items()})
    np.testing.assert_allclose(state[1], alone[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_pool_of_states_is_read_and_written_by_row(llmc_ops: Path, threads: int) -> None:
    """With state_rows, the state is a pool [N, H, K, V]: row b's is its state_rows[b]-th; the others stay."""
    feeds = _inputs(2, 3, 2, 4, 16, 16)
    pool = RNG.standard_normal((5, 4, 16, 16)).astype(np.float32)
    rows = np.array([3, 1], np.int32)
    out, after = _session(llmc_ops, threads, pooled=True).run(None, {**feeds, "state": pool, "state_rows": rows})
    ref_out, ref_state = _reference(*(feeds[n] for n in NAMES[:-1]), pool[rows])
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4 * np.abs(ref_out).max())
    np.testing.assert_allclose(after[rows], ref_state, rtol=1e-4, atol=1e-4 * np.abs(ref_state).max())
    untouched = [0, 2, 4]
    np.testing.assert_array_equal(after[untouched], pool[untouched])
    with pytest.raises(Exception, match=r"state_rows\[1\] = 5 is outside the pool's 5 states"):
        _session(llmc_ops, 1, pooled=True).run(None, {**feeds, "state": pool, "state_rows": np.array([0, 5], np.int32)})


def test_mismatched_shapes_are_named(llmc_ops: Path) -> None:
    feeds = _inputs(1, 2, 2, 4, 16, 16)
    feeds["state"] = feeds["state"][:, :2]
    with pytest.raises(Exception, match=r"GatedDeltaRule: expected q, k \[B, S, Hk, K\]"):
        _session(llmc_ops, 1).run(None, feeds)
    feeds = _inputs(1, 2, 2, 4, 16, 16)
    feeds["g"] = np.zeros((1, 2, 4, 8), np.float32)  # (a decay per key dim, of the wrong count)
    with pytest.raises(Exception, match=r"g \[B, S, H\] or \[B, S, H, K\]"):
        _session(llmc_ops, 1).run(None, feeds)


def _scan_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, dt: np.ndarray, a: np.ndarray,
                    state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' mamba_selective_state_update token by token in float64, the channels as H heads of V: the state
    [B, H, K = d_state, V] (theirs [B, channels, d_state] transposed), B and C (k, q) shared by every channel."""
    m = state.astype(np.float64).copy()
    out = np.zeros(v.shape, np.float64)
    for t in range(q.shape[1]):
        d = dt[:, t].astype(np.float64)  # [B, H, V]
        m = m * np.exp(d[:, :, None, :] * a[None].astype(np.float64))
        m += k[:, t, 0][:, None, :, None] * (d * v[:, t])[:, :, None, :]
        out[:, t] = np.einsum("bhkv,bk->bhv", m, q[:, t, 0].astype(np.float64))
    return out, m


def _scan_inputs(b: int, s: int, h: int, kd: int, vd: int) -> dict[str, np.ndarray]:
    dt = np.log1p(np.exp(RNG.standard_normal((b, s, h, vd)))).astype(np.float32)  # softplus: dt > 0
    return {"q": RNG.standard_normal((b, s, 1, kd)).astype(np.float32),
            "k": RNG.standard_normal((b, s, 1, kd)).astype(np.float32),
            "v": RNG.standard_normal((b, s, h, vd)).astype(np.float32), "g": dt, "beta": dt,
            "state": RNG.standard_normal((b, h, kd, vd)).astype(np.float32),
            "A": -np.exp(RNG.standard_normal((h, kd, vd))).astype(np.float32)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(2, 1, 3, 16, 64), (1, 23, 2, 16, 128), (3, 4, 5, 8, 24), (2, 2, 1, 4, 144)])
def test_the_selective_scan(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str, threads: int,
                            shape: tuple[int, ...]) -> None:
    """A [H, K, V], g = beta = dt [B, S, H, V]: M[i][j] <- M[i][j] exp(dt[j] A[i][j]) + B[i] dt[j] x[j]; o = C M."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    feeds = _scan_inputs(*shape)
    out, state = _session(llmc_ops, threads, delta=0, scan=True).run(None, feeds)
    ref_out, ref_state = _scan_reference(*(feeds[n] for n in ("q", "k", "v", "g", "A", "state")))
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4 * np.abs(ref_out).max())
    np.testing.assert_allclose(state, ref_state, rtol=1e-4, atol=1e-4 * np.abs(ref_state).max())


@pytest.mark.parametrize("threads", [1, 2])
def test_the_scan_on_a_pool_and_its_padding(llmc_ops: Path, threads: int) -> None:
    """The scan reads and writes its rows of a pool; a padded token (dt 0) leaves the state."""
    feeds = _scan_inputs(2, 3, 2, 16, 32)
    feeds["g"][1, 1:] = 0  # row 1 has one token, right-padded to 3
    feeds["beta"] = feeds["g"]
    pool = RNG.standard_normal((4, 2, 16, 32)).astype(np.float32)
    rows = np.array([2, 0], np.int32)
    out, after = _session(llmc_ops, threads, pooled=True, delta=0, scan=True).run(
        None, {**feeds, "state": pool, "state_rows": rows})
    ref_out, ref_state = _scan_reference(*(feeds[n] for n in ("q", "k", "v", "g", "A")), pool[rows])
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4 * np.abs(ref_out).max())
    np.testing.assert_allclose(after[rows], ref_state, rtol=1e-4, atol=1e-4 * np.abs(ref_state).max())
    np.testing.assert_array_equal(after[[1, 3]], pool[[1, 3]])
    one = _scan_reference(*(feeds[n][1:2, :1] for n in ("q", "k", "v", "g")), feeds["A"], pool[0:1])[1]
    np.testing.assert_allclose(after[0], one[0], rtol=1e-5, atol=1e-5 * np.abs(one).max())


def test_the_scan_s_shapes_are_named(llmc_ops: Path) -> None:
    feeds = _scan_inputs(1, 2, 2, 16, 32)
    feeds["A"] = feeds["A"][:, :8]
    with pytest.raises(Exception, match=r"with A \[H, K, V\] \(delta 0\), g and beta \[B, S, H, V\]"):
        _session(llmc_ops, 1, delta=0, scan=True).run(None, feeds)
    feeds = _scan_inputs(1, 2, 2, 16, 32)
    with pytest.raises(Exception, match=r"with A \[H, K, V\] \(delta 0\)"):
        _session(llmc_ops, 1, scan=True).run(None, feeds)  # (the delta rule has no scan)
