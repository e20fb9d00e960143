"""`llmc bench --plot FILE.png`: decode tokens/s against batch size and against context, with the limit drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmc.errors import InputError


def plot(results: list[dict[str, Any]], path: Path, prompt_len: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'llmc[bench]'") from None
    fig, (by_batch, by_ctx) = plt.subplots(1, 2, figsize=(11, 4.2))
    batch_runs = sorted((r for r in results if r["prompt_len"] == prompt_len), key=lambda r: r["batch"])
    xs = [r["batch"] for r in batch_runs]
    by_batch.plot(xs, [r["decode_tok_s_aggregate"] for r in batch_runs], "o-", label="llmc (aggregate)")
    by_batch.plot(xs, [r["bandwidth_limit_tok_s_per_seq"] * r["batch"] for r in batch_runs], "k--",
                  label="bandwidth limit")
    _measured_line(by_batch, xs, batch_runs, per_batch=True)
    if any("torch_decode_tok_s_per_seq" in r for r in batch_runs):
        by_batch.plot(xs, [r.get("torch_decode_tok_s_per_seq", 0) * r["batch"] for r in batch_runs], "s-",
                      label="transformers (aggregate)")
    by_batch.set(xlabel="batch size", ylabel="decode tokens/s", title="decode throughput vs batch", xscale="log")
    ctx_runs = sorted((r for r in results if r["batch"] == 1), key=lambda r: r["prompt_len"])
    cx = [r["prompt_len"] for r in ctx_runs]
    by_ctx.plot(cx, [r["decode_tok_s_per_seq"] for r in ctx_runs], "o-", label="llmc (batch 1)")
    by_ctx.plot(cx, [r["bandwidth_limit_tok_s_per_seq"] for r in ctx_runs], "k--", label="bandwidth limit")
    if any("torch_decode_tok_s_per_seq" in r for r in ctx_runs):
        by_ctx.plot(cx, [r.get("torch_decode_tok_s_per_seq", 0) for r in ctx_runs], "s-", label="transformers")
    _measured_line(by_ctx, cx, ctx_runs, per_batch=False)
    by_ctx.set(xlabel="context (tokens)", ylabel="decode tokens/s", title="decode speed vs context", xscale="log")
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax, ticks in ((by_batch, xs), (by_ctx, cx)):
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
    precision = results[0]["precision"] if results else ""
    fig.suptitle(f"llmc {results[0]['backend'] if results else ''} {precision}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _measured_line(ax: Any, xs: list[int], runs: list[dict[str, Any]], per_batch: bool) -> None:
    """The limit at the read bandwidth this run measured (CPU engines), dotted under the stated one."""
    if runs and all("measured_limit_tok_s_per_seq" in r for r in runs):
        gbs = [g for g in runs[0]["read_bandwidth_gbs"] if g]
        ax.plot(xs, [r["measured_limit_tok_s_per_seq"] * (r["batch"] if per_batch else 1) for r in runs], "k:",
                label=f"limit at the {min(gbs):.0f}-{max(gbs):.0f} GB/s measured around the rounds")
