"""What constrained decoding costs a decode step, for `llmc bench --json-schema`: wall-clock ratios against the
plain run, and an accounting of the time it adds (sampler, waiting for masks, the masks' CPU time) that a busy,
shared machine blurs far less than it blurs the ratios."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from llmc.runtime.generator import EngineLoop
from llmc.runtime.sampler import Sampler, SamplerOutput, SequenceSamplingState


class TimedSampler(Sampler):
    """A sampler that adds up the time its `sample` calls take."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.seconds = 0.0

    def sample(self, logits: np.ndarray, states: Sequence[SequenceSamplingState]) -> SamplerOutput:
        t0 = time.perf_counter()
        try:
            return self.inner.sample(logits, states)
        finally:
            self.seconds += time.perf_counter() - t0


@contextmanager
def timed_sampler(loop: EngineLoop) -> Iterator[TimedSampler]:
    inner = loop.sampler
    loop.sampler = timed = TimedSampler(inner)
    try:
        yield timed
    finally:
        loop.sampler = inner


def grammar_times(loop: EngineLoop, request_ids: list[str]) -> tuple[float, float]:
    """Seconds the requests' sequences waited for masks, and the CPU seconds their masks took."""
    states = [s.sampling.grammar for rid in request_ids for s in loop.requests[rid] if s.sampling.grammar is not None]
    return sum(g.wait_s for g in states), sum(g.compute_s for g in states)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def constrained_report(runs: list[dict[str, float]], plain: list[dict[str, float]]) -> dict[str, Any]:
    """The constrained runs against the plain run just before each (paired: on a shared machine the speed drifts
    between rounds more than between two runs): the median decode speed, the median paired ratio and its range, and
    `json_schema_cost_bound`: (extra sampler time + mask waits + mask CPU time) / the plain step, which counts the
    masks' CPU time as if it all delayed the step (it runs beside it on the workers)."""
    ratios = sorted(p["tpot_ms"] / c["tpot_ms"] for p, c in zip(plain, runs))
    extra = [c["sampler_ms"] - p["sampler_ms"] + c["mask_wait_ms"] + c["mask_cpu_ms"] for p, c in zip(plain, runs)]
    bound = _median([e / p["tpot_ms"] for e, p in zip(extra, plain)])
    return {"json_schema_decode_tok_s_per_seq": round(1e3 / _median([c["tpot_ms"] for c in runs]), 1),
            "json_schema_vs_plain": round(_median(ratios), 3),
            "json_schema_vs_plain_range": [round(ratios[0], 3), round(ratios[-1], 3)],
            "json_schema_tokens": round(_median([c["tokens"] for c in runs]), 1),
            "json_schema_sampler_ms_per_step": round(_median([c["sampler_ms"] for c in runs]), 3),
            "plain_sampler_ms_per_step": round(_median([p["sampler_ms"] for p in plain]), 3),
            "json_schema_mask_wait_ms_per_step": round(_median([c["mask_wait_ms"] for c in runs]), 3),
            "json_schema_mask_cpu_ms_per_step": round(_median([c["mask_cpu_ms"] for c in runs]), 3),
            "json_schema_cost_bound": round(bound, 4)}
