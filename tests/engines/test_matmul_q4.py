"""llmc's 4-, 8- and 2-bit operators (ai.llmc.MatMulQ4, MatMulQ8, MatMulQ2): the packed layouts, the operators against
a numpy reference through ONNX Runtime (AVX-512 VNNI, AVX2 and portable paths, 1 to 14 rows, padded widths, bias,
the SwiGLU gate, with and without the session's thread count, int8 or two-level 16-bit activations), and `llmc
build --quant int4|int8 --matmul llmc` engines end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import Built
from onnx import TensorProto, helper, numpy_helper
from quant_grids import q4_0_like, q4_1_like, q4_k_like, q5_like, q8_0_like

from llmc import LLM, SamplingParams
from llmc.engines.kernels import ops_version
from llmc.engines.ort.build import BuildConfig, build_ort
from llmc.engines.registry import load_engine_dir
from llmc.errors import InputError
from llmc.graph.quant import (
    Q2TILES,
    Q2TILES_GATED,
    Q4TILES,
    Q4TILES_GATED,
    Q8TILES,
    QuantSpec,
    pack_q2_tiles,
    pack_q4_tiles,
    pack_q8_tiles,
    quantize_weights,
    ternary_columns,
    to_bf16_bits,
    unpack_q2_tiles,
    unpack_q4_tiles,
    unpack_q8_tiles,
)
from llmc.runtime.verify import compare_engines

RNG = np.random.default_rng(7)


def _q4_1_like(k: int, n: int) -> np.ndarray:
    return q4_1_like(RNG, k, n, fp16=True)


@pytest.mark.parametrize(("k", "n", "gated"), [(64, 24, False), (96, 40, False), (64, 64, True), (576, 192, True)])
def test_packing_keeps_a_q4_1_grid_exactly(k: int, n: int, gated: bool) -> None:
    w = _q4_1_like(k, n)
    packed = pack_q4_tiles(w, gated)
    assert packed.shape == (-(-n // 32), k // 32, 640) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_q4_tiles(packed, n, gated), w)


@pytest.mark.parametrize(("k", "n", "gated"), [(64, 24, False), (576, 192, True)])
def test_packing_keeps_a_q4_0_grid_exactly(k: int, n: int, gated: bool) -> None:
    """GGUF Q4_0's blocks rarely reach q = 15, so the block's min / max grid would miss their steps: its own grid
    (d = the largest |w| / -8, negative where that w is positive) holds them as they were."""
    w = q4_0_like(np.random.default_rng(k + n), k, n)
    np.testing.assert_array_equal(unpack_q4_tiles(pack_q4_tiles(w, gated), n, gated), w)


def test_packing_holds_a_q4_k_grid_to_its_fp16_scale_and_min() -> None:
    w = q4_k_like(np.random.default_rng(5), 512, 48)
    err = np.linalg.norm(unpack_q4_tiles(pack_q4_tiles(w), 48) - w) / np.linalg.norm(w)
    assert err < 1e-3  # (fp16's rounding of d * sc and dmin * m; half a step would be ~5e-2)


def test_packing_random_weights_is_bounded_by_the_grid() -> None:
    w = RNG.standard_normal((96, 40)).astype(np.float32)
    err = np.abs(unpack_q4_tiles(pack_q4_tiles(w), 40) - w)
    step = (w.reshape(3, 32, 40).max(axis=1) - w.reshape(3, 32, 40).min(axis=1)) / 15
    assert np.all(err.reshape(3, 32, 40) <= step[:, None, :] * 0.51 + 1e-3)  # half a step (+ fp16 scale rounding)


def test_gated_tiles_alternate_gate_and_up() -> None:
    w = _q4_1_like(32, 64)  # gate = columns 0..31, up = 32..63
    plain, gated = pack_q4_tiles(w), pack_q4_tiles(w, gated=True)
    # pair 0 of the gated form = gate tile 0 and up tile 0 = the plain form's tiles 0 and 2
    np.testing.assert_array_equal(gated[0, :, :320], plain[0, :, :320])
    np.testing.assert_array_equal(gated[0, :, 320:], plain[1, :, :320])


def test_pack_refuses_sizes_off_the_block() -> None:
    with pytest.raises(InputError, match="input size 40 is not a multiple of the 4-bit kernel's block of 32"):
        pack_q4_tiles(np.zeros((40, 32), np.float32), name="layers.0.o.weight")
    with pytest.raises(InputError, match="gate/up width 48 is not a multiple of 32"):
        pack_q4_tiles(np.zeros((32, 48), np.float32), gated=True)


def test_quantize_weights_packs_only_the_4_bit_layers() -> None:
    weights = {"a.weight": _q4_1_like(64, 32), "b.gate_up.weight": _q4_1_like(64, 64), "head": _q4_1_like(64, 40)}
    out = quantize_weights(weights, ["a.weight", "b.gate_up.weight"], QuantSpec(4, kernel="llmc"), head="head",
                           gated=("b.gate_up.weight",))
    assert {"a.weight" + Q4TILES, "b.gate_up.weight" + Q4TILES_GATED, "head" + Q8TILES} == set(out)
    ort = quantize_weights(weights, ["a.weight"], QuantSpec(4, kernel="ort"), head="head")
    assert {"a.weight.qweight", "head.qweight"} <= set(ort)  # ONNX Runtime's kernel: MatMulNBits for both


@pytest.mark.parametrize(("k", "n", "gated"), [(64, 24, False), (96, 40, False), (64, 64, True), (576, 192, True)])
def test_8_bit_packing_keeps_a_q8_0_grid_exactly(k: int, n: int, gated: bool) -> None:
    w = q8_0_like(RNG, k, n, fp16=True)
    packed = pack_q8_tiles(w, gated)
    assert packed.shape == (-(-n // 32), k // 32, 1152) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_q8_tiles(packed, n, gated), w)
    # the layout itself: tile 0's block 0 holds k = 4 c + i of its 16 columns at 64 c + 4 j + i as q8 + 128, then
    # the scales d and the mins -128 d
    d = (np.abs(w[:32, :16]).max(axis=0) / 127).astype(np.float16)
    if not gated:
        np.testing.assert_array_equal(packed[0, 0, :512].reshape(8, 16, 4).transpose(0, 2, 1).reshape(32, 16),
                                      np.rint(w[:32, :16] / d.astype(np.float32)) + 128)
        np.testing.assert_array_equal(packed[0, 0, 512:576].copy().view(np.float16), np.concatenate([d, -128 * d]))


@pytest.mark.parametrize("grid", ["q4_1", "q4_0", "q5_1", "q5_0"])
def test_8_bit_packing_keeps_gguf_s_narrower_grids_exactly(grid: str) -> None:
    """A raised GGUF Q4_1 layer, or a Q4_0 / Q5_0 / Q5_1 file built at 8 bits: each block on its own steps (from
    its minimum, or Q4_0's / Q5_0's d from its largest |w|), not the 255ths of its range it lies between."""
    rng = np.random.default_rng(9)
    w = {"q4_1": lambda: q4_1_like(rng, 64, 32, fp16=True), "q4_0": lambda: q4_0_like(rng, 64, 32),
         "q5_1": lambda: q5_like(rng, 64, 32, symmetric=False), "q5_0": lambda: q5_like(rng, 64, 32, symmetric=True)}[grid]()
    back = unpack_q8_tiles(pack_q8_tiles(w), 32)
    np.testing.assert_array_equal(back, w)
    assert not np.array_equal(back, unpack_q8_tiles(pack_q8_tiles(w + 1e-3), 32))  # (not a constant answer)


def test_8_bit_packing_holds_a_q4_k_grid_closer_than_its_255ths() -> None:
    """Q4_K's blocks on their own steps to fp16's rounding of d * sc and dmin * m (measured 1.8e-4), closer than the
    255ths of each block's range (2.1e-4)."""
    w = q4_k_like(np.random.default_rng(11), 512, 48)
    blocks = w.reshape(16, 32, 48)
    lo = blocks.min(axis=1, keepdims=True).astype(np.float16).astype(np.float32)
    step = ((blocks.max(axis=1, keepdims=True) - lo) / 255).astype(np.float16).astype(np.float32)
    plain = (np.clip(np.rint((blocks - lo) / step), 0, 255) * step + lo).reshape(512, 48)
    err, err_plain = (np.linalg.norm(b - w) / np.linalg.norm(w) for b in (unpack_q8_tiles(pack_q8_tiles(w), 48), plain))
    assert err < 0.9 * err_plain, (err, err_plain)


def test_8_bit_packing_random_weights_is_bounded_by_the_grid() -> None:
    w = RNG.standard_normal((96, 40)).astype(np.float32)
    err = np.abs(unpack_q8_tiles(pack_q8_tiles(w), 40) - w).reshape(3, 32, 40)
    blocks = w.reshape(3, 32, 40)
    step = (blocks.max(axis=1) - blocks.min(axis=1)) / 255
    assert np.all(err <= step[:, None, :] * 0.51 + 1e-3 * step[:, None, :] * 255)  # half a step (+ fp16 rounding)
    zeros = np.zeros((64, 32), np.float32)  # a block of zeros: scale 0, values 0
    np.testing.assert_array_equal(unpack_q8_tiles(pack_q8_tiles(zeros), 32), zeros)


def _ternary(k: int, n: int) -> np.ndarray:
    """BitNet's weights: -h, 0 and h in each column, h its own (fp32, not fp16-exact: MatMulQ2 keeps it)."""
    h = RNG.uniform(0.01, 0.1, n).astype(np.float32)
    return (RNG.integers(-1, 2, (k, n)) * h).astype(np.float32)


@pytest.mark.parametrize(("k", "n", "gated"), [(64, 24, False), (96, 40, False), (64, 64, True), (576, 192, True)])
def test_2_bit_packing_keeps_ternary_columns_exactly(k: int, n: int, gated: bool) -> None:
    w = _ternary(k, n)
    w[:, 3] = 0.0  # a column of zeros: scale and min 0
    packed = pack_q2_tiles(w, gated)
    assert packed.shape == (-(-n // 32), k // 32 + 1, 256) and packed.dtype == np.uint8
    np.testing.assert_array_equal(unpack_q2_tiles(packed, n, gated), w)


def test_2_bit_tiles_take_ternary_columns_only() -> None:
    w = _ternary(64, 32)
    assert ternary_columns(w) and ternary_columns(np.zeros((64, 32), np.float32))
    w[40, 5] *= 0.5  # one value off its column's -h, 0, h (past the first rows the quick look reads)
    assert not ternary_columns(w)
    with pytest.raises(ValueError, match="MatMulQ2 holds ternary columns only"):
        pack_q2_tiles(w)
    blocks = np.concatenate([_ternary(32, 16), 3 * _ternary(32, 16)])  # ternary blocks of two scales a column
    assert not ternary_columns(blocks)
    spec = QuantSpec(4, kernel="llmc")
    parts = quantize_weights({"t.weight": _ternary(64, 32), "b.weight": blocks, "g.weight": _ternary(64, 64)},
                             ["t.weight", "b.weight", "g.weight"], spec, gated=("g.weight",))
    assert set(parts) == {"t.weight" + Q2TILES, "b.weight" + Q4TILES, "g.weight" + Q2TILES_GATED}
    eight = quantize_weights({"t.weight": _ternary(64, 32)}, ["t.weight"], QuantSpec(8, kernel="llmc"))
    assert set(eight) == {"t.weight" + Q2TILES}  # (--quant int8 too: the same values in fewer bytes)
    ort = quantize_weights({"t.weight": _ternary(64, 32)}, ["t.weight"], QuantSpec(4, kernel="ort"))
    assert "t.weight" + Q2TILES not in ort  # (MatMulNBits engines keep their forms)


def _int8_level(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One int8 level per block of 32 (last axis), in float32 as in the kernel so ties round alike: q, scale."""
    amax = np.abs(v).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    return np.rint(v * inv), amax / np.float32(127)


def _gate(y: np.ndarray, gated: bool) -> np.ndarray:
    if not gated:
        return y
    gate, up = np.split(y, 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


def _reference(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, gated: bool, act_bits: int = 8) -> np.ndarray:
    """What both operators compute, in float64: x quantized to int8 per block of 32 (scale max|x| / 127; act_bits 16:
    plus its remainder x - scale q quantized the same way) times the weights they hold (matmul_q4.c, quantize_rows:
    the activations' error meets the weights centred on 0, min and all)."""
    k, _ = w.shape
    xb = x.reshape(*x.shape[:-1], k // 32, 32)
    q, s = _int8_level(xb)
    xq = q.astype(np.float64) * s.astype(np.float64)  # int8, back in float
    if act_bits == 16:
        q2, s2 = _int8_level(xb - s * q)  # the remainder, in float32 as in the kernel
        xq += q2.astype(np.float64) * s2.astype(np.float64)
    y = xq.reshape(x.shape) @ w.astype(np.float64)
    return _gate(y + (bias if bias is not None else 0), gated)


def _session(library: Path, k: int, n: int, packed: np.ndarray, bias: np.ndarray | None, gated: bool,
             threads: int, told: int | None, act_bits: int | None = None, op: str = "MatMulQ4",
             int8_prompts: int | None = None, own_pool: bool = False, window: float | None = None,
             act_rows: int | None = None) -> object:
    """A one-node session; `told` is the thread count the library is given (llmc.threads), None for none;
    `act_bits`, `int8_prompts`, `window` None: the node has no such attribute; own_pool: on llmc's pool of `told`
    threads."""
    import onnxruntime as ort

    inputs = ["x", "w"] + (["bias"] if bias is not None else [])
    attrs = {name: v for name, v in (("act_bits", act_bits), ("int8_prompts", int8_prompts), ("window", window),
                                     ("act_rows", act_rows)) if v is not None}
    node = helper.make_node(op, inputs, ["y"], domain="ai.llmc", K=k, N=n, gated=int(gated), **attrs)
    inits = [numpy_helper.from_array(packed, "w")] + ([numpy_helper.from_array(bias, "bias")] if bias is not None
                                                      else [])
    graph = helper.make_graph([node], "q4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", "K"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1 if own_pool else threads
    if told is not None:
        so.add_session_config_entry("llmc.threads", str(told))
    if own_pool:
        so.add_session_config_entry("llmc.pool", "llmc")
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


CASES = [  # k, n, batch, new tokens, gated, bias
    (64, 40, 1, 1, False, False),  # width padded to the tile pair, one row
    (576, 960, 1, 1, False, True),  # SmolLM2's qkv, decode
    (1536, 576, 8, 1, False, False),  # its down projection, batch 8: the 8-row kernel
    (576, 3072, 2, 7, True, False),  # its gate/up, a prompt: 14 rows = 8 + 4 + 2
    (96, 64, 13, 1, True, True),  # 13 rows = 8 + 4 + 1, gated with a bias
    (128, 100, 3, 2, False, True),  # 6 rows = 4 + 2, ragged width
    (576, 192, 2, 13, False, True),  # a 26-row prompt chunk: 3 passes of 8 + 2, with a bias
    (96, 64, 1, 9, True, False),  # 9 rows = 8 + 1, gated
]


PATHS = {"native": {}, "avx2": {"LLMC_KERNELS_AVX2": "1"}, "portable": {"LLMC_KERNELS_GENERIC": "1"}}


@pytest.mark.parametrize("path", list(PATHS))
# (2, 8): more parts than threads, so most units are done by a thread that has finished its own part, from the
# others' ends
@pytest.mark.parametrize(("threads", "told"), [(2, 2), (2, None), (1, 1), (3, 3), (2, 8)])
@pytest.mark.parametrize(("k", "n", "batch", "seq", "gated", "with_bias"), CASES)
def test_operator_matches_the_reference(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str,
                                        threads: int, told: int | None, k: int, n: int, batch: int, seq: int,
                                        gated: bool, with_bias: bool) -> None:
    for name, value in PATHS[path].items():  # (the native path is the best this CPU has)
        monkeypatch.setenv(name, value)
    w = _q4_1_like(k, n)
    bias = RNG.standard_normal(n).astype(np.float32) if with_bias else None
    x = RNG.standard_normal((batch, seq, k)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block: scale 0
    y = _session(llmc_ops, k, n, pack_q4_tiles(w, gated), bias, gated, threads, told).run(None, {"x": x})[0]
    expected = _reference(x, w, bias, gated)
    assert y.shape == expected.shape == (batch, seq, n // 2 if gated else n)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # and the int8 activations cost ~1 % against the exact product (a broken layout would cost ~100 %)
    exact = x.astype(np.float64) @ w + (bias if bias is not None else 0)
    if not gated:
        assert np.abs(y - exact).max() < 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("op", ["MatMulQ4", "MatMulQ8", "MatMulQ2"])
@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (3, 1), (2, 20)])  # (40 rows: past AMX-BF16's, which it skips)
def test_act_rows_are_bitnet_s_integers(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str, op: str,
                                        batch: int, seq: int) -> None:
    """act_rows 1: each row of x on one int8 grid, q = round(x * (127 / max(max |x|, 1e-5))), as transformers'
    BitLinear rounds its input; on ternary weights (-h, 0, h) the product is then the model's integer dot products
    times h and the row's scale, to float32's sums. The default grid per block of 32 misses them."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    k, n, h = 256, 96, np.float32(0.0390625)  # (h exact in fp16)
    t = RNG.integers(-1, 2, size=(k, n)).astype(np.float32)
    x = RNG.standard_normal((batch, seq, k)).astype(np.float32)
    x[..., :32] *= 0.01  # a first block far below the row's largest: its own grid would be finer
    if batch * seq > 1:
        x[-1, -1] = 0.0  # a row of zeros: its grid at 1e-5
    inv = np.float32(127) / np.maximum(np.abs(x).max(axis=-1, keepdims=True), np.float32(1e-5))
    q = np.rint(x * inv)  # (in float32, as transformers: ties to even alike)
    want = (q.astype(np.float64) @ t.astype(np.float64)) * float(h) / inv.astype(np.float64)
    packed = {"MatMulQ4": pack_q4_tiles, "MatMulQ8": pack_q8_tiles, "MatMulQ2": pack_q2_tiles}[op](t * h)
    y = _session(llmc_ops, k, n, packed, None, False, 2, 2, op=op, act_rows=1).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())
    blocks = _session(llmc_ops, k, n, packed, None, False, 2, 2, op=op).run(None, {"x": x})[0]
    assert np.abs(blocks - want).max() > 1e-3 * np.abs(want).max()


def test_act_rows_is_refused_where_it_does_not_apply(llmc_ops: Path) -> None:
    w = pack_q4_tiles(_q4_1_like(64, 32))
    for act_bits, rows in [(16, 1), (8, 2)]:
        with pytest.raises(Exception, match=rf"MatMulQ4: act_rows {rows}: must be 0 \(a grid per block\) or 1"):
            _session(llmc_ops, 64, 32, w, None, False, 2, 2, act_bits, act_rows=rows)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize(("threads", "told"), [(2, 2), (1, 1), (2, 8)])
@pytest.mark.parametrize(("k", "n", "batch", "seq", "gated", "with_bias"), CASES)
def test_2_bit_operator_matches_the_reference_and_the_4_bit_one(
        llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str, act_bits: int, threads: int, told: int, k: int,
        n: int, batch: int, seq: int, gated: bool, with_bias: bool) -> None:
    """MatMulQ2 over ternary columns computes what MatMulQ4 computes over the same weights (each block's dot
    products summed before the column's one scale, not after each block's: float32's rounding apart)."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    w = _ternary(k, n).astype(np.float16).astype(np.float32)  # (h exact in fp16: the 4-bit tiles' too)
    bias = RNG.standard_normal(n).astype(np.float32) if with_bias else None
    x = RNG.standard_normal((batch, seq, k)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block: scale 0
    y2, y4 = (_session(llmc_ops, k, n, pack(w, gated), bias, gated, threads, told, act_bits, op=op).run(None, {"x": x})[0]
              for pack, op in ((pack_q2_tiles, "MatMulQ2"), (pack_q4_tiles, "MatMulQ4")))
    expected = _reference(x, w, bias, gated, act_bits)
    assert y2.shape == expected.shape == (batch, seq, n // 2 if gated else n)
    np.testing.assert_allclose(y2, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_allclose(y2, y4, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_2_bit_operator_names_its_shapes_and_takes_no_window(llmc_ops: Path) -> None:
    packed = pack_q2_tiles(_ternary(64, 32))
    session = _session(llmc_ops, 64, 32, packed, None, False, 2, 2, op="MatMulQ2")
    with pytest.raises(Exception, match=r"MatMulQ2: expected A \[\.\.\., 64\], B \[1, 3, 256\]"):
        session.run(None, {"x": np.zeros((1, 1, 32), np.float32)})
    with pytest.raises(Exception, match=r"MatMulQ2: window 4: must be a finite margin >= 0, and 0 unless"):
        _session(llmc_ops, 64, 32, packed, None, False, 2, 2, 16, op="MatMulQ2", window=4.0)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("k", "n", "batch", "seq", "gated", "with_bias"), CASES)
def test_16_bit_activations_match_their_reference_and_the_float_product(
        llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str, k: int, n: int, batch: int, seq: int,
        gated: bool, with_bias: bool) -> None:
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    w = _q4_1_like(k, n)
    bias = RNG.standard_normal(n).astype(np.float32) if with_bias else None
    x = RNG.standard_normal((batch, seq, k)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block: both scales 0
    if batch * seq > 1:  # one level holds this block exactly (scale 1/64): the remainder's scale is 0
        x[-1, -1, 32:64] = (np.arange(32) * 8 - 127) / 64
    packed = pack_q4_tiles(w, gated)
    y16, y8 = (_session(llmc_ops, k, n, packed, bias, gated, 2, 2, bits).run(None, {"x": x})[0] for bits in (16, 8))
    expected = _reference(x, w, bias, gated, act_bits=16)
    assert y16.shape == expected.shape == (batch, seq, n // 2 if gated else n)
    np.testing.assert_allclose(y16, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # against the float product with the same weights: ~1e-5 of the largest output, where int8 activations cost ~3e-3
    exact = _gate(x.astype(np.float64) @ w + (bias if bias is not None else 0), gated)
    err16, err8 = (np.abs(y - exact).max() / np.abs(exact).max() for y in (y16, y8))
    assert err16 < 1e-4 and err16 < err8 / 30, (err16, err8)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (3, 1), (2, 20)])  # (40 rows: a prompt's arithmetic too)
def test_a_q4_0_grid_s_negative_scales_compute_their_reference(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch,
                                                               path: str, act_bits: int, batch: int, seq: int) -> None:
    """Q4_0's grid keeps a block whose largest |w| is positive with a negative scale: every path multiplies it out
    as any other (its int8 arithmetic, its two levels, a prompt's rows)."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    k, n, rng = 96, 40, np.random.default_rng(batch * seq)
    w = q4_0_like(rng, k, n)
    x = rng.standard_normal((batch, seq, k)).astype(np.float32)
    y = _session(llmc_ops, k, n, pack_q4_tiles(w), None, False, 2, 2, act_bits).run(None, {"x": x})[0]
    expected = _reference(x, w, None, False, act_bits=act_bits)
    if batch * seq >= 32:  # (a prompt's rows may take bf16 tiles: matmul_q4.h, LLMC_Q4_WIDE_ROWS)
        expected = x.astype(np.float64) @ w
        tol = 5e-2 if act_bits == 8 else 1e-2
    else:
        tol = 1e-4
    np.testing.assert_allclose(y, expected, rtol=tol, atol=tol * np.abs(expected).max())


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize(("threads", "told"), [(2, 2), (1, 1), (2, 8)])
@pytest.mark.parametrize(("k", "n", "batch", "seq", "gated", "with_bias"), CASES)
def test_8_bit_operator_matches_the_reference(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str,
                                              act_bits: int, threads: int, told: int, k: int, n: int, batch: int,
                                              seq: int, gated: bool, with_bias: bool) -> None:
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    w = q8_0_like(RNG, k, n, fp16=True)  # Q8_0's symmetric blocks, and a 4-bit grid's (8 bits hold both)
    w[:, : n // 2] = _q4_1_like(k, n)[:, : n // 2]
    bias = RNG.standard_normal(n).astype(np.float32) if with_bias else None
    x = RNG.standard_normal((batch, seq, k)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block: scale 0
    packed = pack_q8_tiles(w, gated)
    y = _session(llmc_ops, k, n, packed, bias, gated, threads, told, act_bits, op="MatMulQ8").run(None, {"x": x})[0]
    held = unpack_q8_tiles(packed, n, gated)  # (the 4-bit grid's half to its fp16 scale)
    expected = _reference(x, held, bias, gated, act_bits)
    assert y.shape == expected.shape == (batch, seq, n // 2 if gated else n)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    exact = _gate(x.astype(np.float64) @ held + (bias if bias is not None else 0), gated)
    err = np.abs(y - exact).max() / np.abs(exact).max()  # int8 activations ~1e-2, 16-bit ones ~1e-4
    assert err < (5e-2 if act_bits == 8 else 5e-4), err  # (a broken layout: ~1)


@pytest.mark.parametrize("path", ["native", "avx2"])
@pytest.mark.parametrize(("op", "act_bits"), [("MatMulQ4", 8), ("MatMulQ4", 16), ("MatMulQ8", 8), ("MatMulQ8", 16),
                                             ("MatMulQ2", 8)])
@pytest.mark.parametrize("batch", [1, 8])
def test_weight_prefetches_into_l1_or_l2_change_no_bit(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str,
                                                        op: str, act_bits: int, batch: int) -> None:
    """Where the weights' streaming prefetches go (prefetch.h: L2 on x86 unless told, at three distances on AMD's
    CPUs; LLMC_PREFETCH picks any on any CPU) changes no bit of a decode product; a long K (48 blocks) runs past
    every distance."""
    from llmc.engines.kernels import cpu_paths

    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    k, n = 1536, 96
    w = _ternary(k, n) if op == "MatMulQ2" else _q4_1_like(k, n)
    packed = {"MatMulQ4": pack_q4_tiles, "MatMulQ8": pack_q8_tiles, "MatMulQ2": pack_q2_tiles}[op](w, False)
    x = RNG.standard_normal((batch, 1, k)).astype(np.float32)
    y = {}
    for level in ("l1", "l2", "l2x3"):
        monkeypatch.setenv("LLMC_PREFETCH", level)
        assert cpu_paths()["prefetch"] == level
        y[level] = _session(llmc_ops, k, n, packed, None, False, 2, 2, act_bits, op=op).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y["l1"], y["l2"])
    np.testing.assert_array_equal(y["l1"], y["l2x3"])
    held = unpack_q8_tiles(packed, n, False) if op == "MatMulQ8" else w
    expected = _reference(x, held, None, False, act_bits)
    np.testing.assert_allclose(y["l2"], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_the_prefetch_level_is_l2_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """L2 on every x86 CPU (measured better on AMD's Zen 4 and Intel's Emerald Rapids, within noise on Sapphire
    Rapids), on AMD's the products' weights at three distances (measured on Zen 4: prefetch.h); LLMC_PREFETCH=l1,
    l2 or l2x3 overrides, anything else is ignored."""
    from llmc.engines.kernels import cpu_paths

    amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    for value in (None, "l3", "L2", "", "l2x", "l1", "l2", "l2x3"):
        if value is None:
            monkeypatch.delenv("LLMC_PREFETCH", raising=False)
        else:
            monkeypatch.setenv("LLMC_PREFETCH", value)
        default = "l2x3" if amd else "l2"
        assert cpu_paths()["prefetch"] == (value if value in ("l1", "l2", "l2x3") else default)


PROMPT_CASES = [  # k, n, batch, new tokens, gated, bias: 32 rows or more (matmul_q4.h, LLMC_Q4_WIDE_ROWS)
    (576, 960, 1, 40, False, True),  # SmolLM2's qkv, a 40-token prompt: 32 + 8 rows read from the spare ones
    (576, 3072, 2, 33, True, False),  # its gate/up, two prompts: 66 rows
    (1536, 576, 1, 64, False, False),  # its down projection, 64 rows: two whole spans of 32
    (96, 100, 1, 32, False, True),  # a ragged width (the last tile pair half used)
    (4096, 64, 2, 100, True, True),  # 200 rows in row blocks of 96, each block's x kept in L2
]


def _amx() -> bool:
    from llmc.engines.kernels import cpu_paths

    return cpu_paths()["matmul_q4"] == "avx512-vnni+amx-bf16"


def _bf16(v: np.ndarray) -> np.ndarray:
    return (to_bf16_bits(v).astype(np.uint32) << 16).view(np.float32)


def _prompt_weights(bits: int, k: int, n: int, gated: bool) -> tuple[np.ndarray, np.ndarray]:
    """Packed weights of `bits` and the values they hold."""
    if bits == 4:
        w = _q4_1_like(k, n)
        return pack_q4_tiles(w, gated), w
    w = q8_0_like(RNG, k, n, fp16=True)
    packed = pack_q8_tiles(w, gated)
    return packed, unpack_q8_tiles(packed, n, gated)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize(("threads", "told"), [(2, 2), (2, None), (1, 1), (2, 8)])
@pytest.mark.parametrize(("k", "n", "batch", "seq", "gated", "with_bias"), PROMPT_CASES)
def test_prompts_compute_what_this_cpu_s_prompt_path_does(llmc_ops: Path, bits: int, act_bits: int, threads: int,
                                                          told: int | None, k: int, n: int, batch: int, seq: int,
                                                          gated: bool, with_bias: bool) -> None:
    """From 32 rows on, where the CPU grants AMX-BF16 tiles: x and the expanded weights rounded to bf16 (one level,
    act_bits 16 too), fp32 sums, nearer x @ W than int8 activations; elsewhere the int8 arithmetic of few rows."""
    packed, w = _prompt_weights(bits, k, n, gated)
    bias = RNG.standard_normal(n).astype(np.float32) if with_bias else None
    x = RNG.standard_normal((batch, seq, k)).astype(np.float32)
    x[0, 0, :32] = 0.0
    op = f"MatMulQ{bits}"
    y = _session(llmc_ops, k, n, packed, bias, gated, threads, told, act_bits, op=op).run(None, {"x": x})[0]
    if _amx():
        expected = _gate(_bf16(x).astype(np.float64) @ _bf16(w).astype(np.float64) + (bias if bias is not None else 0),
                         gated)
    else:
        expected = _reference(x, w, bias, gated, act_bits)
    assert y.shape == expected.shape == (batch, seq, n // 2 if gated else n)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    if _amx():
        exact = _gate(x.astype(np.float64) @ w + (bias if bias is not None else 0), gated)
        # nearer x @ W than int8 activations are (the root-mean-square errors: the largest is one draw of few sums)
        err, err8 = (np.sqrt(np.mean((v - exact) ** 2)) for v in (y, _reference(x, w, bias, gated)))
        assert err < 0.7 * err8, (err, err8)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rows", [1, 40])
def test_the_gate_holds_at_large_and_small_values(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str,
                                                  rows: int) -> None:
    """silu(gate) * up where the gate reaches +-100s (silu's tails: 0 below, the gate itself above), decode's rows
    and a prompt's, against the float64 gate on what each path computes."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    k, n = 64, 256
    w = _q4_1_like(k, n)
    x = (RNG.standard_normal((1, rows, k)) * 60).astype(np.float32)
    y = _session(llmc_ops, k, n, pack_q4_tiles(w, True), None, True, 2, 2).run(None, {"x": x})[0]
    pre = _session(llmc_ops, k, n, pack_q4_tiles(w, False), None, False, 2, 2).run(None, {"x": x})[0]
    gate = pre[..., : n // 2].astype(np.float64)  # the ungated product of the same arithmetic
    assert np.abs(gate).max() > 100 and (gate < -30).any() and (gate > 30).any()
    expected = gate * 0.5 * (1 + np.tanh(gate / 2)) * pre[..., n // 2:]  # (sigmoid without exp's overflow)
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=1e-6 * np.abs(expected).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("env", "int8_prompts"), [({}, 1), ({"LLMC_KERNELS_NO_AMX": "1"}, None)])
def test_prompts_take_the_int8_arithmetic_when_asked(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, bits: int,
                                                     env: dict[str, str], int8_prompts: int | None) -> None:
    """int8_prompts 1 (the calibration graph) or LLMC_KERNELS_NO_AMX: a prompt's rows on decode's arithmetic, on
    every CPU."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    k, n, batch, seq, gated, _ = PROMPT_CASES[1]
    packed, w = _prompt_weights(bits, k, n, gated)
    x = RNG.standard_normal((batch, seq, k)).astype(np.float32)
    session = _session(llmc_ops, k, n, packed, None, gated, 2, 2, 16, op=f"MatMulQ{bits}", int8_prompts=int8_prompts)
    expected = _reference(x, w, None, gated, 16)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("path", ["native", "portable"])
@pytest.mark.parametrize(("bits", "act_bits"), [(4, 8), (4, 16), (8, 16)])
def test_a_prompt_s_activations_quantized_over_threads_change_no_bit(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      path: str, bits: int, act_bits: int) -> None:
    """A prompt's rows (16 or more) are quantized in parts over the pool's threads, with the same arithmetic on
    AVX-512 and in C: 1, 2 and 3 threads give the same bits, 37 rows of K 576 (the parts end mid-row, in whole
    groups of blocks) on decode's int8 arithmetic."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    k, n = 576, 64
    packed, _ = _prompt_weights(bits, k, n, False)
    x = RNG.standard_normal((1, 37, k)).astype(np.float32)
    y = [_session(llmc_ops, k, n, packed, None, False, t, t, act_bits, op=f"MatMulQ{bits}", int8_prompts=1).run(
        None, {"x": x})[0] for t in (1, 2, 3)]
    np.testing.assert_array_equal(y[0], y[1])
    np.testing.assert_array_equal(y[0], y[2])


WINDOW_ROWS = 2  # matmul_q4.h: LLMC_Q4_WINDOW_ROWS


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("op", ["MatMulQ4", "MatMulQ8"])
@pytest.mark.parametrize(("threads", "told"), [(2, 2), (1, 1)])
@pytest.mark.parametrize(("batch", "seq", "n", "with_bias"), [
    (1, 1, 200, False),  # one row: two levels throughout
    (2, 1, 200, True),  # decode's batch of 2 with a bias
    (9, 1, 100, False),  # 9 rows = 8 + 1, the last tile 4 columns wide
    (3, 4, 72, True),  # a 12-row prompt (no AMX tiles at 12 rows), ragged
])
def test_a_window_takes_the_second_level_only_near_each_row_s_largest(
        llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str, op: str, threads: int, told: int, batch: int,
        seq: int, n: int, with_bias: bool) -> None:
    """window w (act_bits 16): from WINDOW_ROWS rows on, every 16-column tile is act_bits 8's value except those
    holding an act_bits 8 value within w of its row's largest, which are act_bits 16's: the same bits as each."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    k = 128
    if op == "MatMulQ8":
        w = q8_0_like(RNG, k, n, fp16=True)
        packed = pack_q8_tiles(w)
    else:
        w = _q4_1_like(k, n)
        packed = pack_q4_tiles(w)
    bias = RNG.standard_normal(n).astype(np.float32) if with_bias else None
    x = RNG.standard_normal((batch, seq, k)).astype(np.float32) + 1.0
    run = {bits: _session(llmc_ops, k, n, packed, bias, False, threads, told, bits, op=op).run(None, {"x": x})[0]
           for bits in (8, 16)}
    y8, y16 = run[8].reshape(-1, n), run[16].reshape(-1, n)
    tiles = -(-n // 16)
    padded = np.pad(y8, ((0, 0), (0, tiles * 16 - n)), constant_values=-np.inf)
    gaps = y8.max(-1, keepdims=True) - padded.reshape(-1, tiles, 16).max(-1)  # each tile's below its row's largest
    window = float(np.median(gaps, -1).min()) * 0.9  # every row keeps more than half its tiles at one level
    got = _session(llmc_ops, k, n, packed, bias, False, threads, told, 16, op=op, window=window).run(
        None, {"x": x})[0].reshape(-1, n)
    if batch * seq < WINDOW_ROWS:
        np.testing.assert_array_equal(got, y16)
        return
    near = (padded >= y8.max(-1, keepdims=True) - window).reshape(-1, tiles, 16).any(-1)
    expected = np.where(np.repeat(near, 16, -1)[:, :n], y16, y8)
    np.testing.assert_array_equal(got, expected)
    assert near.any(-1).all() and not near.all(), near.sum(-1)  # each row has tiles on both sides
    assert not np.array_equal(y8, y16)


def test_a_window_is_refused_where_it_does_not_apply(llmc_ops: Path) -> None:
    w = pack_q4_tiles(_q4_1_like(64, 32))
    for act_bits, gated, window, why in [(8, False, 4.0, "window 4: must be"), (16, True, 4.0, "window 4: must be"),
                                         (16, False, -1.0, "window -1: must be"),
                                         (16, False, float("inf"), "window inf: must be")]:
        with pytest.raises(Exception, match=rf"MatMulQ4: {why} a finite margin >= 0, and 0 unless act_bits is 16 "
                                            rf"without a gate \(act_bits {act_bits}, gated {int(gated)}\)"):
            _session(llmc_ops, 64, 32, w, None, gated, 2, 2, act_bits, window=window)
    _session(llmc_ops, 64, 32, w, None, False, 2, 2, 8, window=0.0)  # 0: off, with any act_bits


def test_8_bit_operator_names_the_shapes_it_expected(llmc_ops: Path) -> None:
    session = _session(llmc_ops, 64, 32, pack_q8_tiles(q8_0_like(RNG, 64, 32)), None, False, 2, 2, op="MatMulQ8")
    with pytest.raises(Exception, match=r"MatMulQ8: expected A \[\.\.\., 64\], B \[1, 2, 1152\]"):
        session.run(None, {"x": np.zeros((1, 1, 32), np.float32)})
    with pytest.raises(Exception, match=r"MatMulQ8: act_bits 12: must be 8 .* or 16"):
        _session(llmc_ops, 64, 32, pack_q8_tiles(q8_0_like(RNG, 64, 32)), None, False, 2, 2, 12, op="MatMulQ8")


def test_act_bits_defaults_to_8_and_is_8_or_16(llmc_ops: Path) -> None:
    w, x = _q4_1_like(64, 32), RNG.standard_normal((1, 3, 64)).astype(np.float32)
    default, eight = (_session(llmc_ops, 64, 32, pack_q4_tiles(w), None, False, 2, 2, bits).run(None, {"x": x})[0]
                      for bits in (None, 8))
    np.testing.assert_array_equal(default, eight)
    for bits in (0, 12):
        with pytest.raises(Exception, match=rf"MatMulQ4: act_bits {bits}: must be 8 .* or 16"):
            _session(llmc_ops, 64, 32, pack_q4_tiles(w), None, False, 2, 2, bits).run(None, {"x": x})


def test_operator_names_the_shapes_it_expected(llmc_ops: Path) -> None:
    w = _q4_1_like(64, 32)
    session = _session(llmc_ops, 64, 32, pack_q4_tiles(w), None, False, 2, 2)
    with pytest.raises(Exception, match=r"MatMulQ4: expected A \[\.\.\., 64\], B \[1, 2, 640\]"):
        session.run(None, {"x": np.zeros((1, 1, 32), np.float32)})


# -- engines ---------------------------------------------------------------------------------------------------


# SwiGLU gated; q/k/v bias; GELU (plain MatMulQ4 for fc); GeGLU with soft-caps; experts (each its own MatMulQ4s)
# and a shared expert (gated, beside its fp32 sigmoid gate)
Q4_ARCHS = ("llama", "qwen2", "gpt2", "gemma2", "qwen2_moe")
Q4_NODES = {"qwen2_moe": 2 + 4 * 2 + 2 + 4}  # layer 0: qkv, o, 4 experts x (gate_up, down), shared; layer 1 dense


@pytest.fixture(scope="module")
def q4_engines(tiny_factory: object, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, ...]]:
    """Per architecture: int4 with llmc's kernel; int4 with MatMulNBits' exact form and fp32 activations; the same
    with MatMulNBits' int8 activations (what llmc's kernel does too)."""
    root = tmp_path_factory.mktemp("q4")
    out = {}
    for arch in Q4_ARCHS:
        built: Built = tiny_factory(arch)  # type: ignore[operator]
        mine, exact, ort_int8 = root / f"{arch}-llmc", root / f"{arch}-exact", root / f"{arch}-ort"
        lossy = {"allow_divergence": True, "attention": "gqa", "quality_target": 0.0}  # (random tiny weights: 4 bits change greedy answers)
        build_ort(BuildConfig(built.export_dir, mine, quant="int4", matmul="llmc", **lossy))
        build_ort(BuildConfig(built.export_dir, exact, quant="int4", quant_scheme="minmax", accuracy_level=0,
                              matmul="ort", **lossy))
        build_ort(BuildConfig(built.export_dir, ort_int8, quant="int4", quant_scheme="minmax", accuracy_level=4,
                              matmul="ort", **lossy))
        out[arch] = (mine, exact, ort_int8)
    return out


@pytest.mark.parametrize("arch", Q4_ARCHS)
def test_engine_computes_what_the_exact_int4_form_computes(arch: str, q4_engines: dict[str, tuple[Path, ...]]
                                                            ) -> None:
    mine, exact, ort_int8 = q4_engines[arch]
    graph = onnx.load(str(mine / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulQ4") == Q4_NODES.get(arch, 4 * 2)  # per layer: qkv, o, gate/up (gated) or fc, down
    # or proj
    head = [n for n in graph.node if n.op_type == "MatMulQ8"]
    assert len(head) == 1 and head[0].input[1] == "lm_head.weight" + Q8TILES  # the 8-bit head, in llmc's operator
    assert "MatMulNBits" not in ops
    if arch in ("llama", "qwen2"):
        assert "Sigmoid" not in ops  # the SwiGLU gate is inside the node
    manifest = json.loads((mine / "engine.json").read_text())
    assert manifest["settings"]["matmul"] == "llmc" and manifest["settings"]["llmc_ops"] == ops_version()
    prompts = [[1, 5, 9, 13, 2], [3, 3, 7]]
    reference = load_engine_dir(exact)
    report = compare_engines(reference, load_engine_dir(mine), prompts, steps=6)
    baseline = compare_engines(reference, load_engine_dir(ort_int8), prompts, steps=6)
    # the same weights (up to fp16 scales), so what is left is the int8 activations: no worse than ONNX Runtime's
    # (measured: llama KL 2.5e-3 vs 1.4e-2, qwen2 1.2e-2 vs 0.73, gpt2 8.8e-5 vs 3.0e-5 on these random models)
    assert report["mean_kl"] <= min(max(1.5 * baseline["mean_kl"], 1e-3), 0.05), (report, baseline)
    assert report["top1_agreement"] >= 0.8, (report, baseline)


def test_engine_generates_in_a_batch_as_alone(q4_engines: dict[str, tuple[Path, ...]]) -> None:
    llm = LLM(q4_engines["llama"][0])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "Hello", "1 2 3 4 5 6 7 8 9"]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone and all(len(t) == 8 for t in together)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"matmul": "llmc"}, "--matmul llmc is the quantized layers' kernel: it needs --quant int4 or int8 .got --quant "
                         "none."),
    ({"matmul": "llmc", "quant": "int4", "block_size": 64}, "works in blocks of 32, got --block-size 64"),
    ({"matmul": "fast", "quant": "int4"}, "--matmul must be one of auto, ort, llmc, got 'fast'"),
])
def test_build_refuses_matmul_llmc_where_it_does_not_apply(tiny_llama: Built, tmp_path: Path, kwargs: dict[str, object],
                                                           message: str) -> None:
    with pytest.raises(InputError, match=message):
        build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "e", **kwargs))  # type: ignore[arg-type]
    assert not (tmp_path / "e").exists()


def test_a_4_bit_head_goes_to_the_operator_too(tiny_llama: Built, tmp_path: Path) -> None:
    from llmc.engines.ort.graphs import load_checkpoint, quantized, write_inplace_graphs
    from llmc.manifest import load_export

    export = load_export(tiny_llama.export_dir)
    spec = QuantSpec(4, head_bits=4, kernel="llmc")
    ckpt = quantized(load_checkpoint(tiny_llama.export_dir, export), spec)
    _, graph, _ = write_inplace_graphs(ckpt, tmp_path, export.dtype, export.opset, spec, fuse_norms=True,
                                       one_graph=True)
    ops = [n.op_type for n in onnx.load(str(tmp_path / graph.file), load_external_data=False).graph.node]
    assert ops.count("MatMulQ4") == 4 * 2 + 1  # not the fp32 embedding through a Gemm
    assert "Gemm" not in ops and "MatMulNBits" not in ops


@pytest.mark.parametrize("arch", Q4_ARCHS)
def test_int8_engine_runs_every_layer_in_the_8_bit_operator(arch: str, tiny_factory: object, tmp_path: Path) -> None:
    """--quant int8 --matmul llmc: every linear layer and the head in MatMulQ8 (the SwiGLU gate inside the node;
    biases; GELU; experts), computing what MatMulNBits' 8-bit form with the same int8 activations computes, and
    generating in a batch as alone."""
    built: Built = tiny_factory(arch)  # type: ignore[operator]
    lossy = {"allow_divergence": True, "attention": "gqa", "quality_target": 0.0}
    mine, ort_int8 = tmp_path / "llmc", tmp_path / "ort"
    build_ort(BuildConfig(built.export_dir, mine, quant="int8", matmul="llmc", **lossy))
    build_ort(BuildConfig(built.export_dir, ort_int8, quant="int8", matmul="ort", quant_scheme="symmetric", **lossy))
    ops = [n.op_type for n in onnx.load(str(mine / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulQ8") == Q4_NODES.get(arch, 4 * 2) + 1 and "MatMulNBits" not in ops
    if arch in ("llama", "qwen2"):
        assert "Sigmoid" not in ops  # the SwiGLU gate is inside the node
    prompts = [[1, 5, 9, 13, 2], [3, 3, 7]]
    report = compare_engines(load_engine_dir(ort_int8), load_engine_dir(mine), prompts, steps=6)
    # measured: mean KL 0.8-1.1e-4 against MatMulNBits' symmetric form; top-1 14/14 but gpt2's 12/14 (near ties)
    assert report["top1_agreement"] >= 0.8 and report["mean_kl"] < 1e-3, report
    llm = LLM(mine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(["Hello", "1 2 3 4 5 6"], params)]
    assert together == [llm.generate([p], params)[0].outputs[0].token_ids for p in ("Hello", "1 2 3 4 5 6")]
