"""`llmc bench --serve URL`: load a running OpenAI-compatible server at several concurrency levels."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer

from llmc.errors import InputError


def bench_serve(url: str, levels: tuple[int, ...], num_prompts: int, prompt_len: int, new_tokens: int,
                request_rate: float, output: Path | None, as_json: bool) -> None:
    from llmc.bench.serve_client import BenchConfig, format_report, run_bench

    if not levels or min(levels) < 1:
        raise InputError(f"--concurrency must be >= 1, got {list(levels)}")
    if num_prompts < 1 or request_rate < 0:
        raise InputError(f"--num-prompts must be >= 1 and --request-rate >= 0, got {num_prompts}, {request_rate}")
    reports = []
    for level in levels:
        cfg = BenchConfig(url=url, num_prompts=max(num_prompts, level), concurrency=level,
                          request_rate=request_rate or float("inf"), prompt_len=prompt_len, max_tokens=new_tokens)
        report = asyncio.run(run_bench(cfg))
        report["concurrency"] = level
        reports.append(report)
        typer.echo(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}) if as_json
                   else f"--- concurrency {level} ---\n{format_report(report)}")
    if output is not None:
        output.write_text(json.dumps(reports, indent=2))
