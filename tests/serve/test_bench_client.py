"""The serving benchmark client against a live server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from llmc.bench.serve_client import BenchConfig, format_report, make_prompt, run_bench

from .conftest import MODEL, Server


def test_bench_by_concurrency_reports_vllm_fields_and_saves_json(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cfg = BenchConfig(url=server.url, num_prompts=6, concurrency=3, prompt_len=16, max_tokens=8, output=out)
    report = asyncio.run(run_bench(cfg))
    assert report["model"] == MODEL and report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == 6 * 8
    assert report["total_input_tokens"] == sum(len(server.llm.encode_chat(
        [{"role": "user", "content": make_prompt(16, i)}])) for i in range(6))
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert report[f"{stat}_{key}_ms"] >= 0
    assert report["mean_e2el_ms"] >= report["mean_ttft_ms"] > 0
    assert report["output_throughput"] > 0 and report["total_token_throughput"] > report["output_throughput"]
    assert json.loads(out.read_text())["completed"] == 6
    text = format_report(report)
    assert "Output token throughput" in text and "P99 ITL" in text
    server.wait_idle()


def test_bench_by_poisson_rate_on_completions(server: Server) -> None:
    cfg = BenchConfig(url=server.url, model=MODEL, num_prompts=5, request_rate=50.0, prompt_len=8, max_tokens=4,
                      endpoint="completions")
    report = asyncio.run(run_bench(cfg))
    assert report["completed"] == 5 and report["total_output_tokens"] == 20


def test_bench_counts_failures(server: Server) -> None:
    cfg = BenchConfig(url=server.url, model="no-such-model", num_prompts=2, max_tokens=2, prompt_len=4)
    report = asyncio.run(run_bench(cfg))
    assert report["completed"] == 0 and report["failed"] == 2 and "404" in report["errors"][0]


def test_bench_serve_against_a_peer_prints_both_and_the_ratios(server: Server, tmp_path: Path,
                                                              capsys: object) -> None:
    from llmc.cli.bench_serve import bench_serve

    out = tmp_path / "cmp.json"
    # the same server as its own peer: both columns measure one server, so each ratio is near 1
    bench_serve(server.url, (1, 2), 2, 8, 4, 0.0, out, False, peer=server.url, repeat=2, warmup=1)
    text = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "against peer" in text and "medians of 2 interleaved rounds" in text
    saved = json.loads(out.read_text())
    assert [r["concurrency"] for r in saved["comparison"]] == [1, 2]
    assert len(saved["runs"]) == 2 * 2 * 2 and {r["server"] for r in saved["runs"]} == {"llmc", "peer"}
    for row in saved["comparison"]:
        assert row["rounds"] == 2 and row["failed"] == row["peer_failed"] == 0
        assert row["ratio_output_throughput"] == row["output_throughput"] / row["peer_output_throughput"]
        assert 0.2 < row["ratio_output_throughput"] < 5
        assert f"{row['concurrency']:>11} " in text
    server.wait_idle()
