"""Paged KV memory and prefix caching, measured in one run (docs/kv_cache.md): capacity at a KV budget, TTFT of
requests sharing a long system prompt with and without prefix caching, and the prompt tokens computed per turn of
a multi-turn chat.

    .venv/bin/python scripts/bench_kv_cache.py --paged out/kv-paged-int4 --paged-int8 out/kv-paged-int4-kv8

One JSON line per measurement on stdout. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from llmc.engines.registry import load_engine_dir
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.generator import EngineLoop
from llmc.runtime.llm import LLM
from llmc.runtime.request import SamplingParams


def emit(**row: object) -> None:
    print(json.dumps(row), flush=True)


def capacity(engine_dir: Path, budget_mb: int, requests: int, prompt_len: int, new_tokens: int) -> None:
    """`requests` chat-sized requests at once: how many decode together, preemptions, output tokens/s; and how many
    sequences the slot layout holds in the same budget (each slot sized for the model's context, or for exactly
    one request)."""
    config = RuntimeConfig(max_running=requests, kv_budget_mb=budget_mb, max_step_tokens=2048)
    engine = load_engine_dir(engine_dir, config.engine_options())
    loop = EngineLoop(engine, None, config)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(requests):
        loop.add_request(rng.integers(100, 10000, prompt_len).tolist(), params)
    running, start, decoding = [], time.perf_counter(), 0
    while loop.has_work:
        loop.step()
        s = loop.stats()
        running.append(s.running)
        decoding = max(decoding, s.running)
    seconds = time.perf_counter() - start
    per_token = engine.kv_bytes_per_token()
    budget = budget_mb * 2**20
    emit(bench="capacity", engine=str(engine_dir), kv_dtype=engine.manifest.kv.dtype, budget_mb=budget_mb,
         requests=requests, prompt_len=prompt_len, new_tokens=new_tokens, kv_blocks=loop.stats().kv_blocks_total,
         kv_tokens=loop.stats().kv_capacity_tokens, most_running=decoding,
         running_at_last_full_step=running[-2] if len(running) > 1 else running[-1],
         all_decoded_together=decoding == requests and loop.stats().preemptions == 0,
         preemptions=loop.stats().preemptions, seconds=round(seconds, 2),
         output_tokens_per_s=round(requests * new_tokens / seconds, 1),
         slot_layout_sequences_at_full_context=budget // (per_token * engine.max_positions),
         slot_layout_sequences_at_request_length=budget // (per_token * (prompt_len + new_tokens)),
         model_context=engine.max_positions)


def shared_prefix(engine_dir: Path, requests: int, system_tokens: int, question_tokens: int, new_tokens: int) -> None:
    """`requests` requests with the same system prompt and different short questions, all at once after one warm
    request, with prefix caching and without (the same engine, one run): TTFT p50 / p90 of each."""
    rng = np.random.default_rng(1)
    system = rng.integers(100, 10000, system_tokens).tolist()
    questions = [rng.integers(100, 10000, question_tokens).tolist() for _ in range(requests)]
    engine = load_engine_dir(engine_dir)
    results = {}
    for caching in (True, False):
        config = RuntimeConfig(max_running=requests, kv_budget_mb=1024, max_step_tokens=2048,
                               prefix_caching=caching)
        loop = EngineLoop(engine, None, config)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        warm = loop.add_request(system + rng.integers(100, 10000, question_tokens).tolist(), params)
        while loop.has_work:
            loop.step()
        loop.pop(warm)
        queried, hits = loop.stats().prefix_queried_tokens, loop.stats().prefix_hit_tokens
        start = time.perf_counter()
        rids = {loop.add_request(system + q, params): i for i, q in enumerate(questions)}
        ttft: dict[str, float] = {}
        outputs = {}
        while loop.has_work:
            for u in loop.step():
                if u.token_ids and u.request_id not in ttft:
                    ttft[u.request_id] = time.perf_counter() - start
        for rid in rids:
            outputs[rid] = loop.pop(rid).outputs[0].token_ids
        t = np.array(list(ttft.values())) * 1e3
        s = loop.stats()
        results[caching] = (float(np.median(t)), [outputs[r] for r in rids])
        emit(bench="shared_prefix", prefix_caching=caching, requests=requests, system_tokens=system_tokens,
             question_tokens=question_tokens, ttft_ms_p50=round(float(np.median(t)), 1),
             ttft_ms_p90=round(float(np.percentile(t, 90)), 1),
             prompt_tokens_computed=(s.prefix_queried_tokens - queried) - (s.prefix_hit_tokens - hits),
             prompt_tokens=requests * (system_tokens + question_tokens))
    emit(bench="shared_prefix_ratio", ttft_p50_cached_vs_uncached=round(results[True][0] / results[False][0], 3),
         same_tokens=results[True][1] == results[False][1])


def multi_turn(engine_dir: Path, turns: int, new_tokens: int) -> None:
    """A chat of `turns` turns through the model's template: per turn, the prompt's tokens, those cached, those
    computed, and how many are new since the previous turn's prompt and answer."""
    llm = LLM(engine_dir, RuntimeConfig(max_running=1, kv_budget_mb=256))
    loop = llm.loop
    messages = [{"role": "system", "content": "You are a concise assistant that answers questions about cities."}]
    previous: list[int] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Tell me one fact about city number {turn + 1}, please."})
        ids = llm.encode_chat(messages)  # type: ignore[arg-type]
        before = loop.stats()
        rid = loop.add_request(ids, SamplingParams(max_tokens=new_tokens, temperature=0.0))
        while loop.has_work:
            loop.step()
        out = loop.pop(rid)
        after = loop.stats()
        hit = after.prefix_hit_tokens - before.prefix_hit_tokens
        common = next((i for i, (a, b) in enumerate(zip(ids, previous)) if a != b), min(len(ids), len(previous)))
        emit(bench="multi_turn", turn=turn + 1, prompt_tokens=len(ids), cached_tokens=hit,
             computed_tokens=len(ids) - hit, new_since_last_turn=len(ids) - common,
             reply_tokens=len(out.outputs[0].token_ids))
        text = llm.tokenizer.decode(out.outputs[0].token_ids) if llm.tokenizer else ""
        messages.append({"role": "assistant", "content": text})
        previous = ids + out.outputs[0].token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paged", type=Path, required=True, help="a paged engine (fp16 KV)")
    p.add_argument("--paged-int8", type=Path, help="the same with an int8 KV cache, for the capacity run")
    p.add_argument("--budget-mb", type=int, default=256)
    p.add_argument("--skip", default="", help="comma-separated: capacity, prefix, turns")
    a = p.parse_args()
    skip = set(a.skip.split(","))
    if "capacity" not in skip:
        for engine in (a.paged, a.paged_int8):
            if engine is not None:
                capacity(engine, a.budget_mb, 64, 128, 128)
    if "prefix" not in skip:
        shared_prefix(a.paged, 32, 1000, 16, 8)
    if "turns" not in skip:
        multi_turn(a.paged, 4, 24)


if __name__ == "__main__":
    main()
