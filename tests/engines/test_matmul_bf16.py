"""llmc's bf16 operator (ai.llmc.MatMulBF16): the packed layout, and the operator against a numpy reference of its
arithmetic (x rounded to bf16 to nearest-even, exact products, fp32 sums) through ONNX Runtime, on its AMX-BF16,
AVX-512 BF16, widened (AVX-512F, AVX2) and portable paths, over one and several threads, with and without a bias,
widths off the tile."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmc.graph.quant import pack_bf16_tiles, to_bf16_bits

RNG = np.random.default_rng(5)


def _from_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _session(library: Path, k: int, n: int, packed: np.ndarray, bias: np.ndarray | None, threads: int,
             gated: bool = False) -> object:
    import onnxruntime as ort

    inputs = ["x", "w"] + (["bias"] if bias is not None else [])
    node = helper.make_node("MatMulBF16", inputs, ["y"], domain="ai.llmc", K=k, N=n, **({"gated": 1} if gated else {}))
    inits = [numpy_helper.from_array(packed, "w")] + ([numpy_helper.from_array(bias, "bias")] if bias is not None
                                                      else [])
    graph = helper.make_graph([node], "bf16", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", "K"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("llmc.threads", str(threads))
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_packing_keeps_each_value_in_its_place() -> None:
    w = RNG.standard_normal((6, 20)).astype(np.float32)
    packed = pack_bf16_tiles(w).view(np.uint16)
    assert packed.shape == (2, 3, 32)
    bits = to_bf16_bits(w)
    for k in range(6):
        for col in range(20):
            assert packed[col // 16, k // 2, 2 * (col % 16) + k % 2] == bits[k, col]
    assert not packed[1, :, 2 * 4:].any()  # columns 20..31: zeros


def test_rounding_is_to_nearest_even() -> None:
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -9, -2.5, np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(_from_bits(to_bf16_bits(x)), [1.0, 1.0, 1.0 + 2 ** -6, 1.0, -2.5, np.inf, -np.inf])
    nans = np.array([0x7FFFFFFF, 0xFFC00001, 0x7F800001], np.uint32).view(np.float32)  # the largest would carry into -0
    assert np.isnan(_from_bits(to_bf16_bits(nans))).all()


@pytest.mark.parametrize("path", ["native", "avx512", "avx512f", "avx2", "portable"])
def test_a_nan_activation_stays_in_its_row_on_every_path(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch,
                                                         path: str) -> None:
    """x rounded to bf16 keeps a NaN a NaN (as vcvtneps2bf16 does; the integer rounding carried 0x7FFFFFFF into -0):
    the row holding it comes out NaN and the others as they would without it, on 1 row and on 8 (AMX where
    granted), 16 columns of x wide enough for the vector rounding."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    k, n = 64, 32
    w = RNG.standard_normal((k, n)).astype(np.float32)
    for rows in (1, 8):
        x = RNG.standard_normal((1, rows, k)).astype(np.float32)
        clean = _session(llmc_ops, k, n, pack_bf16_tiles(w), None, 1).run(None, {"x": x})[0]
        x[0, rows - 1, 17] = np.array([0x7FFFFFFF], np.uint32).view(np.float32)[0]
        y = _session(llmc_ops, k, n, pack_bf16_tiles(w), None, 1).run(None, {"x": x})[0]
        assert np.isnan(y[0, rows - 1]).all()
        np.testing.assert_array_equal(y[0, : rows - 1], clean[0, : rows - 1])


CASES = [(64, 48, 1, False), (576, 960, 1, True), (2, 3, 5, False),
         (1536, 576, 8, False), (96, 40, 13, True),  # AMX where granted: one row block (weights prefetched past K 256)
         (576, 200, 37, True),  # AMX where granted: 2 row blocks + a tail of one, 13 tiles (the last unit one tile)
         (64, 32, 16, False), (30, 16, 20, False)]  # AMX: one row block exactly; K off its 32: AVX-512
PATHS = {"native": {}, "avx512": {"LLMC_KERNELS_NO_AMX": "1"},
         # the weights widened to fp32 in registers (CPUs without AVX512_BF16): AVX-512F, AVX2 + FMA
         "avx512f": {"LLMC_KERNELS_NO_AMX": "1", "LLMC_KERNELS_NO_BF16": "1"}, "avx2": {"LLMC_KERNELS_AVX2": "1"},
         "portable": {"LLMC_KERNELS_GENERIC": "1"}}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("k", "n", "rows", "with_bias"), CASES)
def test_operator_matches_its_arithmetic(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str, threads: int,
                                         k: int, n: int, rows: int, with_bias: bool) -> None:
    for name, value in PATHS[path].items():  # native: the best this CPU has (AMX-BF16 from 4 rows where granted)
        monkeypatch.setenv(name, value)
    w = RNG.standard_normal((k, n)).astype(np.float32)
    bias = RNG.standard_normal(n).astype(np.float32) if with_bias else None
    x = RNG.standard_normal((1, rows, k)).astype(np.float32)
    y = _session(llmc_ops, k, n, pack_bf16_tiles(w), bias, threads).run(None, {"x": x})[0]
    wq, xq = _from_bits(to_bf16_bits(w)).astype(np.float64), _from_bits(to_bf16_bits(x)).astype(np.float64)
    expected = xq @ wq + (bias if bias is not None else 0)
    assert y.shape == (1, rows, n)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # against the fp32 product: bf16's 8 bits of mantissa on both sides, ~1e-2 of the largest output at most
    exact = x.astype(np.float64) @ w + (bias if bias is not None else 0)
    assert np.abs(y - exact).max() < 2e-2 * np.abs(exact).max()


@pytest.mark.parametrize("rows", [1, 3])
def test_weight_prefetches_into_l1_or_l2_change_no_bit(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch,
                                                        rows: int) -> None:
    """The AVX-512 path's weight prefetches into L1 or L2 (prefetch.h; LLMC_PREFETCH picks either on any CPU): the
    same bits, over a K long enough (768 pairs) to run past both distances."""
    from llmc.engines.kernels import cpu_paths

    monkeypatch.setenv("LLMC_KERNELS_NO_AMX", "1")
    k, n = 1536, 64
    w = RNG.standard_normal((k, n)).astype(np.float32)
    x = RNG.standard_normal((1, rows, k)).astype(np.float32)
    y = {}
    for level in ("l1", "l2"):
        monkeypatch.setenv("LLMC_PREFETCH", level)
        assert cpu_paths()["prefetch"] == level
        y[level] = _session(llmc_ops, k, n, pack_bf16_tiles(w), None, 2).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y["l1"], y["l2"])
    wq, xq = _from_bits(to_bf16_bits(w)).astype(np.float64), _from_bits(to_bf16_bits(x)).astype(np.float64)
    np.testing.assert_allclose(y["l2"], xq @ wq, rtol=1e-5, atol=1e-5 * np.abs(xq @ wq).max())


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("k", "n", "rows", "with_bias"), [(576, 3072, 1, False), (64, 64, 8, True),
                                                           (96, 96, 37, True), (1536, 32, 2, False)])
def test_gated_form_is_silu_of_the_gate_times_up(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, path: str, k: int,
                                                 n: int, rows: int, with_bias: bool) -> None:
    """gated: W = [gate | up] packed with its tiles alternating, y [.., N / 2] = silu(x @ gate) * (x @ up) (bias in
    [gate | up] order), on every path: 1 and 2 rows on AVX-512, 8 on one AMX row block, 37 on two and a tail."""
    for name, value in PATHS[path].items():
        monkeypatch.setenv(name, value)
    w = RNG.standard_normal((k, n)).astype(np.float32) / np.sqrt(k) * 4  # gates into silu's tails too
    bias = RNG.standard_normal(n).astype(np.float32) if with_bias else None
    x = RNG.standard_normal((1, rows, k)).astype(np.float32)
    y = _session(llmc_ops, k, n, pack_bf16_tiles(w, gated=True), bias, 2, gated=True).run(None, {"x": x})[0]
    wq, xq = _from_bits(to_bf16_bits(w)).astype(np.float64), _from_bits(to_bf16_bits(x)).astype(np.float64)
    both = xq @ wq + (bias if bias is not None else 0)
    gate, up = both[..., : n // 2], both[..., n // 2:]
    expected = gate / (1 + np.exp(-gate)) * up
    assert y.shape == (1, rows, n // 2)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_gated_form_needs_whole_tile_pairs(llmc_ops: Path) -> None:
    with pytest.raises(ValueError, match="gate/up width that is a multiple of 32, got 48"):
        pack_bf16_tiles(np.zeros((4, 48), np.float32), gated=True)
    w = pack_bf16_tiles(RNG.standard_normal((64, 48)).astype(np.float32))
    with pytest.raises(Exception, match=r"MatMulBF16: K must be positive and even, N positive \(gated: a multiple"):
        _session(llmc_ops, 64, 48, w, None, 1, gated=True)


def test_operator_names_the_shapes_it_expected(llmc_ops: Path) -> None:
    w = pack_bf16_tiles(RNG.standard_normal((64, 32)).astype(np.float32))
    with pytest.raises(Exception, match=r"MatMulBF16: expected A \[\.\.\., 64\], B \[2, 32, 32\]"):
        _session(llmc_ops, 64, 32, w, None, 1).run(None, {"x": np.zeros((1, 1, 62), np.float32)})


def test_paths_are_chosen_by_the_cpu_and_forced_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmc.bench.limits import cpu_flags
    from llmc.engines.kernels import cpu_paths

    flags = cpu_flags()
    native = cpu_paths()["matmul_bf16"]
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        assert native in ("avx512-bf16", "amx-bf16")
    elif "avx512f" in flags:  # (an AVX-512 CPU whose BF16 instructions are absent or masked, as on some VMs)
        assert native == "avx512f-widened"
    elif {"avx2", "fma"} <= flags:
        assert native == "avx2-widened"
    avx2 = {"avx2", "fma"} <= flags
    for name, path in [("LLMC_KERNELS_AVX2", "avx2-widened" if avx2 else "portable"),
                       ("LLMC_KERNELS_GENERIC", "portable")]:
        with monkeypatch.context() as m:
            m.setenv(name, "1")
            assert cpu_paths()["matmul_bf16"] == path
    if "avx512f" in flags:
        monkeypatch.setenv("LLMC_KERNELS_NO_BF16", "1")
        assert cpu_paths()["matmul_bf16"] == "avx512f-widened"


@pytest.mark.parametrize(("k", "n", "rows"), [(576, 192, 1), (1536, 96, 8), (96, 64, 13), (64, 48, 37)])
def test_widened_paths_sum_as_the_bf16_instructions_do(llmc_ops: Path, monkeypatch: pytest.MonkeyPatch, k: int,
                                                        n: int, rows: int) -> None:
    """The AVX-512F and AVX2 paths add each pair's products in vdpbf16ps' order (odd k, then even) with FMAs on exact
    products: the same bits as each other for any row count, and as the AVX-512 BF16 path (where this CPU has it) to
    fp32's last bits."""
    w = RNG.standard_normal((k, n)).astype(np.float32)
    x = RNG.standard_normal((1, rows, k)).astype(np.float32)
    y = {}
    for path in ("avx512f", "avx2", "avx512"):
        with monkeypatch.context() as m:
            for name, value in PATHS[path].items():
                m.setenv(name, value)
            y[path] = _session(llmc_ops, k, n, pack_bf16_tiles(w), None, 2).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y["avx512f"], y["avx2"])
    np.testing.assert_allclose(y["avx512"], y["avx512f"], rtol=1e-6, atol=1e-6 * np.abs(y["avx512f"]).max())
