"""fp16 exports through the in-place engine, and `llmc bench` on a tiny engine (fields, JSON, plot)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Built
from typer.testing import CliRunner

from llmc.cli.main import app
from llmc.engines.ort_build import BuildConfig, build_ort
from llmc.export.exporter import ExportConfig, export

BENCH_FIELDS = {"backend", "precision", "batch", "prompt_len", "new_tokens", "ttft_ms", "prefill_tok_s",
                "decode_tok_s_per_seq", "decode_tok_s_aggregate", "peak_rss_mb", "fraction_of_limit",
                "bandwidth_limit_tok_s_per_seq", "kv_bytes_copied_per_step", "itl_ms_p99"}


def test_fp16_export_builds_and_matches_its_golden(tiny_llama: Built, tmp_path: Path) -> None:
    manifest = export(ExportConfig(str(tiny_llama.hf_dir), tmp_path / "export16", dtype="float16"))
    assert manifest.kv.dtype == "float16" and manifest.parity["top1_agreement"] == 1.0
    engine = build_ort(BuildConfig(tmp_path / "export16", tmp_path / "engine16"))
    assert engine.precision == "float16"
    assert engine.settings["parity"]["max_abs_diff"] < 0.05


@pytest.mark.parametrize("layout", ["default", "concat"])
def test_bench_json_has_every_field(tiny_llama: Built, layout: str, tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine(layout)), "--batch-sizes", "1,2",
                                      "--prompt-len", "16", "--new-tokens", "8", "--contexts", "32", "--json",
                                      "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["batch"], r["prompt_len"]) for r in rows] == [(1, 16), (2, 16), (1, 32)]
    for r in rows:
        assert BENCH_FIELDS <= r.keys()
        assert r["decode_tok_s_aggregate"] == pytest.approx(r["decode_tok_s_per_seq"] * r["batch"], rel=0.01)
        assert (r["kv_bytes_copied_per_step"] == 0) == (layout == "default")
    assert plot.stat().st_size > 1000


def test_bench_rejects_bad_values(tiny_llama: Built) -> None:
    result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine_dir), "--batch-sizes", "0"])
    assert result.exit_code == 1 and "--batch-sizes must be >= 1" in result.stderr
    result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine_dir), "--batch-sizes", "a,b"])
    assert result.exit_code == 1 and "comma-separated integers" in result.stderr
