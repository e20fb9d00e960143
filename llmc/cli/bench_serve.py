"""`llmc bench --serve URL [--peer URL]`: load a running OpenAI-compatible server at several concurrency levels,
and, with --peer, a second server (llama.cpp's llama-server, vLLM, another llmc) the same way in the same run."""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from llmc.errors import InputError
from llmc.outdir import check_out_file

if TYPE_CHECKING:
    from llmc.bench.serve_client import BenchConfig

# what the comparison table shows per level: (report key, column title, higher is better)
COMPARED = (("output_throughput", "output tok/s", True), ("median_ttft_ms", "TTFT p50 ms", False),
            ("median_tpot_ms", "TPOT p50 ms", False))


def bench_serve(url: str, levels: tuple[int, ...], num_prompts: int, prompt_len: int, new_tokens: int,
                request_rate: float, output: Path | None, as_json: bool, peer: str | None = None,
                repeat: int = 1, warmup: int = 2) -> None:
    from llmc.bench.serve_client import BenchConfig, format_report

    if not levels or min(levels) < 1:
        raise InputError(f"--concurrency must be >= 1, got {list(levels)}")
    if not request_rate >= 0:
        raise InputError(f"--request-rate must be >= 0 (0 = as fast as allowed), got {request_rate}")
    if repeat < 1:
        raise InputError(f"--repeat must be >= 1, got {repeat}")
    check_load(num_prompts, prompt_len, "--new-tokens", new_tokens, output)
    servers = {"llmc": url} if peer is None else {"llmc": url, "peer": peer}
    reports: list[dict[str, Any]] = []
    rows = []
    # Every round sends prompts no earlier round sent (both servers the same ones): a prompt cache then saves what
    # it would for new users (the chat template's prefix), not a whole prompt it has seen before.
    first = 0
    for level in levels:
        per: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for base in servers.values():  # untimed warm-up requests, one at a time
            if warmup:
                load(BenchConfig(url=base, num_prompts=warmup, concurrency=1, prompt_len=prompt_len,
                                 max_tokens=min(new_tokens, 16), first_prompt=first))
        first += warmup
        for _ in range(repeat):
            n = max(num_prompts, level)
            for name, base in servers.items():  # interleaved rounds: both servers see the same machine state
                cfg = BenchConfig(url=base, num_prompts=n, concurrency=level, first_prompt=first,
                                  request_rate=request_rate or float("inf"), prompt_len=prompt_len,
                                  max_tokens=new_tokens)
                report = load(cfg)
                report["concurrency"], report["server"] = level, name
                per[name].append(report)
                reports.append(report)
                if peer is None:
                    typer.echo(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}) if as_json
                               else f"--- concurrency {level} ---\n{format_report(report)}")
            first += n
        if peer is not None:
            row = compare_level(level, per["llmc"], per["peer"])
            rows.append(row)
            if as_json:
                typer.echo(json.dumps(row))
    if peer is not None and not as_json:
        typer.echo(format_comparison(rows, url, peer, repeat))
    if output is not None:
        output.write_text(json.dumps({"runs": reports, "comparison": rows} if peer is not None else reports,
                                     indent=2))


def check_load(num_prompts: int, prompt_len: int, tokens_flag: str, tokens: int, output: Path | None) -> None:
    """The load `llmc bench --serve` and `llmc serve-bench` send, checked before the first request."""
    if num_prompts < 1:
        raise InputError(f"--num-prompts must be >= 1, got {num_prompts}")
    if prompt_len < 1 or tokens < 1:
        raise InputError(f"--prompt-len and {tokens_flag} must be >= 1, got {prompt_len}, {tokens}")
    if output is not None:
        check_out_file(output, "--output")


def load(cfg: BenchConfig) -> dict[str, Any]:
    """One `run_bench`; a server that cannot be reached, or refuses GET /v1/models, is an InputError naming it."""
    import httpx

    from llmc.bench.serve_client import run_bench

    try:
        return asyncio.run(run_bench(cfg))
    except (httpx.HTTPError, httpx.InvalidURL) as e:  # only GET /v1/models raises: a failed request is a result
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"no OpenAI-compatible server at {cfg.url}: {first}") from None


def compare_level(level: int, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of each compared figure for both servers, and llmc's ratio (llmc / peer)."""
    row: dict[str, Any] = {"concurrency": level, "rounds": len(ours),
                           "failed": sum(r["failed"] for r in ours), "peer_failed": sum(r["failed"] for r in theirs)}
    for key, _, _ in COMPARED:
        a, b = statistics.median(r[key] for r in ours), statistics.median(r[key] for r in theirs)
        row[key], row[f"peer_{key}"] = a, b
        row[f"ratio_{key}"] = a / b if b else float("inf")
    return row


def format_comparison(rows: list[dict[str, Any]], url: str, peer: str, repeat: int) -> str:
    lines = [f"llmc {url} against peer {peer}: medians of {repeat} interleaved rounds per level (ratio = llmc / peer)",
             f"{'concurrency':>11} " + " ".join(f"{title:>14} {'peer':>9} {'ratio':>6}" for _, title, _ in COMPARED)]
    for row in rows:
        cells = " ".join(f"{row[key]:>14.1f} {row[f'peer_{key}']:>9.1f} {row[f'ratio_{key}']:>5.2f}x"
                         for key, _, _ in COMPARED)
        failed = f"  (failed: llmc {row['failed']}, peer {row['peer_failed']})" if row["failed"] or row[
            "peer_failed"] else ""
        lines.append(f"{row['concurrency']:>11} {cells}{failed}")
    return "\n".join(lines)
