"""Weight-only quantization: exact forms, the MatMulNBits graphs, and int8/int4 engines end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import Built
from quant_grids import q4_1_like, q8_0_like
from typer.testing import CliRunner

from llmc import LLM, SamplingParams
from llmc.cli.main import app
from llmc.engines.ort.build import BuildConfig, build_ort
from llmc.engines.registry import load_engine_dir
from llmc.errors import InputError
from llmc.graph.quant import (
    BLOCKSUMS,
    OFFSETS,
    QWEIGHT,
    SCALES,
    QuantSpec,
    blocksum_matrix,
    dequantize,
    quantize,
)
from llmc.runtime.verify import compare_engines

RNG = np.random.default_rng(0)


def _q4_1_like(k: int, n: int) -> np.ndarray:
    return q4_1_like(RNG, k, n)


def _q8_0_like(k: int, n: int) -> np.ndarray:
    return q8_0_like(RNG, k, n)


@pytest.mark.parametrize("bits", [4, 8])
def test_minmax_reproduces_a_q4_1_grid_exactly(bits: int) -> None:
    w = _q4_1_like(64, 24)
    spec = QuantSpec(bits, scheme="minmax")
    assert np.abs(dequantize(quantize(w, spec), spec) - w).max() < 1e-5


@pytest.mark.parametrize(("bits", "k"), [(4, 64), (8, 64), (4, 1536)])  # 1536: 48 blocks, offsets span 2 blocks
def test_folded_keeps_a_q4_1_grid_to_offset_precision(bits: int, k: int) -> None:
    w = _q4_1_like(k, 24)
    spec = QuantSpec(bits, scheme="folded")
    parts = quantize(w, spec)
    assert OFFSETS not in parts and BLOCKSUMS in parts
    err = np.abs(dequantize(parts, spec) - w)
    # the per-block grid steps are kept; only the offsets O = min + 2^(bits-1) * step are rounded: 4-bit as a
    # coarse value (step max|O| / 7) plus its remainder (step <= max|O| / 98), 8-bit as one value (max|O| / 127)
    blocks = w.reshape(k // 32, 32, 24)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    offsets = lo + 2 ** (bits - 1) * (hi - lo) / (2**bits - 1)
    assert err.max() <= np.abs(offsets).max() / (196 if bits == 4 else 254) * 1.01
    assert err.max() > 0  # not the exact form: a test that would notice the offsets going missing below
    kb = k // 32
    dropped = {QWEIGHT: parts[QWEIGHT][:, :kb], SCALES: parts[SCALES].reshape(24, -1)[:, :kb].reshape(-1)}
    assert np.abs(dequantize(dropped, spec) - w).max() > 100 * err.max()


def test_blocksum_matrix_sums_each_block_into_each_offset_part() -> None:
    spec = QuantSpec(4)
    packed, scales = blocksum_matrix(96, spec)
    assert packed.shape == (64, 3, 16) and np.all(scales == 1)  # 2 parts x 32 rows, 3 blocks along K
    e = dequantize({QWEIGHT: packed, SCALES: scales}, spec)  # a plain symmetric 4-bit weight
    x = RNG.standard_normal(96).astype(np.float32)
    sums = x.reshape(3, 32).sum(axis=1)
    np.testing.assert_allclose((x @ e)[[0, 1, 2, 32, 33, 34]], np.tile(sums, 2), rtol=1e-5)
    assert np.all((x @ e)[3:32] == 0) and np.all((x @ e)[35:] == 0)


def test_auto_uses_symmetric_where_exact_and_folded_elsewhere() -> None:
    spec = QuantSpec(8)
    q8 = _q8_0_like(64, 24)
    parts = quantize(q8, spec)
    assert set(parts) == {QWEIGHT, SCALES}  # no block offsets: the fastest kernel path
    assert np.abs(dequantize(parts, spec) - q8).max() < 1e-6
    assert BLOCKSUMS in quantize(_q4_1_like(64, 24), spec)


@pytest.mark.parametrize(("bits", "tol"), [(4, 0.07), (8, 0.005)])
def test_random_weights_error_is_bounded_by_the_grid(bits: int, tol: float) -> None:
    w = RNG.standard_normal((96, 40)).astype(np.float32)
    spec = QuantSpec(bits)
    rel = np.abs(dequantize(quantize(w, spec), spec) - w).max() / np.abs(w).max()
    assert rel < tol


def test_input_size_must_be_a_multiple_of_the_block() -> None:
    with pytest.raises(InputError, match="not a multiple of --block-size 32"):
        quantize(np.zeros((40, 8), np.float32), QuantSpec(4), "layers.0.qkv.weight")


# ONNX Runtime's MatMulNBits (not the default 4-bit operator), kept though random tiny weights change greedy answers
MATMUL_NBITS = {"matmul": "ort", "attention": "gqa", "allow_divergence": True, "quality_target": 0.0}


@pytest.fixture(scope="module")
def quant_engines(tiny_llama: Built, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for quant in ("int8", "int4"):
        out[quant] = root / quant
        build_ort(BuildConfig(tiny_llama.export_dir, out[quant], quant=quant, accuracy_level=0, **MATMUL_NBITS))
    out["int4-minmax"] = root / "int4-minmax"
    build_ort(BuildConfig(tiny_llama.export_dir, out["int4-minmax"], quant="int4", accuracy_level=0,
                          quant_scheme="minmax", **MATMUL_NBITS))
    return out


def test_folded_offsets_match_the_exact_fp32_offsets(quant_engines: dict[str, Path]) -> None:
    """The default int4 graph (offsets folded into 4-bit rows) computes what the exact form computes, closely."""
    import onnx

    folded, exact = (load_engine_dir(quant_engines[q]) for q in ("int4", "int4-minmax"))
    graph = onnx.load(str(quant_engines["int4"] / "model.onnx"), load_external_data=False).graph
    assert not any(n.op_type in ("MatMul", "ReduceSum") for n in graph.node)  # no fp32 offset path left
    prompts = [[1, 5, 9, 13, 2], [3, 3, 7]]
    report = compare_engines(exact, folded, prompts, steps=6)
    assert report["top1_agreement"] >= 0.9 and report["mean_kl"] < 1e-5, report  # symmetric: ~1e-2


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_engines_load_and_generate(quant: str, quant_engines: dict[str, Path]) -> None:
    manifest = json.loads((quant_engines[quant] / "engine.json").read_text())
    assert manifest["precision"] == f"{quant}-float32" and manifest["kv"]["layout"] == "inplace"
    outs = LLM(quant_engines[quant]).generate(["The capital of France is", "Hello"],
                                              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert manifest["settings"]["parity"]["top1_agreement"] >= 0.5


def test_verify_passes_and_fails_on_the_threshold(quant_engines: dict[str, Path]) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(quant_engines["int8"]), "--min-top1", "0.5", "--steps", "4"])
    assert ok.exit_code == 0, ok.output
    assert "top-1 agreement" in ok.output and "mean KL" in ok.output
    lines = [line.split(": ", 1)[1] for line in ok.output.splitlines()
             if line.startswith(("vs export (", "decoded together (8 rows a step"))]
    assert len(lines) == 2 and lines[0] == lines[1], ok.output  # its rows do not depend on their batch
    strict = runner.invoke(app, ["verify", str(quant_engines["int4"]), "--min-top1", "0", "--max-kl", "0",
                                 "--steps", "4"])
    assert strict.exit_code == 1
    assert "above --max-kl" in strict.stderr
    strict = runner.invoke(app, ["verify", str(quant_engines["int4"]), "--min-top1", "1", "--steps", "4"])
    assert strict.exit_code == 1 or "top-1 agreement 100.0%" in strict.output
    assert strict.exit_code == 0 or "below --min-top1 100.0%" in strict.stderr
    for flag, value, message in (("--max-kl", "-1", "--max-kl must be >= 0"), ("--min-top1", "1.5", "[0, 1]")):
        bad = runner.invoke(app, ["verify", str(quant_engines["int4"]), flag, value])
        assert bad.exit_code == 1 and message in bad.stderr and value in bad.stderr


def test_quant_needs_the_inplace_layout(tiny_llama: Built, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--quant needs --kv-layout inplace"):
        build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "e", quant="int4", kv_layout="concat"))
