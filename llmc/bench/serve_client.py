"""Load an OpenAI-compatible server and measure it, like `vllm bench serve`.

Each request streams (`stream_options.include_usage`, so token counts are the server's). Per request: TTFT (time
to the first chunk with text), ITL (time between text chunks), TPOT ((latency - TTFT) / (output tokens - 1)),
end-to-end latency. Load is a Poisson process of `request_rate` requests/s (inf: all at once), capped at
`concurrency` requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmc.errors import InputError

# ~1 token per word for the usual BPE vocabularies; the true count comes back in `usage`.
_WORDS = ("the quick brown fox jumps over the lazy dog while a small model writes a long story about "
          "rivers mountains cities and people who live near the sea").split()


@dataclass(frozen=True)
class BenchConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first of GET /v1/models
    num_prompts: int = 64
    concurrency: int | None = None  # None: no cap
    request_rate: float = float("inf")
    prompt_len: int = 128  # tokens, approximately
    max_tokens: int = 128
    ignore_eos: bool = True
    endpoint: str = "chat"  # "chat" | "completions"
    seed: int = 0
    first_prompt: int = 0  # index of the first prompt: distinct ranges give prompts no cache has seen
    timeout_s: float = 600.0
    output: Path | None = None


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_prompt(n_tokens: int, index: int) -> str:
    """A fixed text of about `n_tokens` tokens; the index up front keeps prompts distinct."""
    words = [_WORDS[(index + i) % len(_WORDS)] for i in range(max(1, n_tokens - 2))]
    return f"{index}: " + " ".join(words)


def _body(cfg: BenchConfig, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens, "stream": True, "temperature": 0.0,
                            "stream_options": {"include_usage": True}, "ignore_eos": cfg.ignore_eos}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return text


async def _one(client: Any, path: str, body: dict[str, Any]) -> RequestResult:
    r = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = str(chunk["error"].get("message"))
                    return r
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if r.ttft == 0.0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    r.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    r.output_tokens = chunk["usage"]["completion_tokens"]
        r.latency = time.perf_counter() - start
        r.ok = True
    except Exception as e:  # a failed request is a result, not the end of the benchmark
        r.error = f"{type(e).__name__}: {e}"
    return r


async def _first_model(client: Any) -> str:
    """The first model GET /v1/models lists; InputError when the answer is not an OpenAI model list."""
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, LookupError, TypeError):  # not JSON, no data, an empty list, not objects
        raise InputError(f"GET {resp.url} answered {resp.text[:80]!r}, not an OpenAI list of models") from None


async def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Send `cfg.num_prompts` streaming requests; return the metrics (and save them when `cfg.output`)."""
    import httpx

    limit = cfg.concurrency or cfg.num_prompts
    # A connection per request: a kept-alive one the server has closed while idle fails the next request with
    # "Server disconnected without sending a response" (llama-server does this between sequential requests); a new
    # local connection costs well under a millisecond of TTFT.
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), timeout=cfg.timeout_s, limits=limits) as client:
        model = cfg.model or await _first_model(client)
        path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
        gate = asyncio.Semaphore(limit)
        rng = np.random.default_rng(cfg.seed)

        async def limited(i: int) -> RequestResult:
            async with gate:
                return await _one(client, path, _body(cfg, model, make_prompt(cfg.prompt_len, cfg.first_prompt + i)))

        start = time.perf_counter()
        tasks = []
        for i in range(cfg.num_prompts):
            tasks.append(asyncio.create_task(limited(i)))
            if np.isfinite(cfg.request_rate) and i + 1 < cfg.num_prompts:
                await asyncio.sleep(float(rng.exponential(1.0 / cfg.request_rate)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    report = summarize(cfg, model, results, duration)
    if cfg.output is not None:
        Path(cfg.output).write_text(json.dumps(report, indent=2))
    return report


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.array(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"p90_{name}_ms": float(np.percentile(ms, 90)), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(cfg: BenchConfig, model: str, results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The `vllm bench serve` report fields, plus the per-request values."""
    ok = [r for r in results if r.ok]
    tin, tout = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report: dict[str, Any] = {
        "model": model, "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": tin, "total_output_tokens": tout,
        "request_throughput": len(ok) / duration, "output_throughput": tout / duration,
        "total_token_throughput": (tin + tout) / duration,
    }
    report |= _stats("ttft", [r.ttft for r in ok]) | _stats("tpot", tpots)
    report |= _stats("itl", [x for r in ok for x in r.itl]) | _stats("e2el", [r.latency for r in ok])
    report["errors"] = [r.error for r in results if not r.ok][:20]
    report["per_request"] = {"input_lens": [r.prompt_tokens for r in ok], "output_lens": [r.output_tokens for r in ok],
                             "ttfts": [r.ttft for r in ok], "latencies": [r.latency for r in ok]}
    return report


def format_report(report: dict[str, Any]) -> str:
    """A `vllm bench serve`-style table."""
    rows = [("Successful requests", report["completed"]), ("Failed requests", report["failed"]),
            ("Benchmark duration (s)", report["duration_s"]), ("Total input tokens", report["total_input_tokens"]),
            ("Total generated tokens", report["total_output_tokens"]),
            ("Request throughput (req/s)", report["request_throughput"]),
            ("Output token throughput (tok/s)", report["output_throughput"]),
            ("Total token throughput (tok/s)", report["total_token_throughput"])]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"--- {title} ---", None))
        rows += [(f"{stat.capitalize()} {key.upper()} (ms)", report[f"{stat}_{key}_ms"])
                 for stat in ("mean", "median", "p90", "p99")]
    lines = ["============ Serving Benchmark Result ============"]
    for name, value in rows:
        if value is None:
            lines.append(f"{name:-^50}")
        else:
            lines.append(f"{name:<40}{value:>10.2f}" if isinstance(value, float) else f"{name:<40}{value:>10}")
    lines.append("=" * 50)
    return "\n".join(lines)
