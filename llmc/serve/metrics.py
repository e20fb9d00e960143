"""Prometheus metrics mirroring vLLM's, under an `llmc_` prefix, in a registry of the app's own."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmc.runtime.async_engine import AsyncEngine, StreamUpdate

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """Gauges read the engine's stats at scrape time; histograms and counters are fed by `RequestTracker`s."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        gauges = {
            "llmc_num_requests_running": ("Sequences holding a KV slot.", lambda: engine.stats().running),
            "llmc_num_requests_waiting": ("Sequences waiting for a KV slot.", lambda: engine.stats().waiting),
            "llmc_kv_cache_usage_perc": ("KV cache usage: cached tokens / capacity (1 = full).",
                                         lambda: engine.stats().kv_usage),
            "llmc_kv_blocks_used": ("KV blocks held by running sequences.", lambda: engine.stats().kv_blocks_used),
            "llmc_kv_blocks_cached": ("KV blocks held by none, kept for prefix reuse.",
                                      lambda: engine.stats().kv_blocks_cached),
            "llmc_kv_blocks_total": ("KV blocks in the engine's memory.", lambda: engine.stats().kv_blocks_total),
            "llmc_prefix_cache_queried_tokens": ("Prompt tokens looked up in the prefix cache since start.",
                                                 lambda: engine.stats().prefix_queried_tokens),
            "llmc_prefix_cache_hit_tokens": ("Prompt tokens found in the prefix cache since start (not computed).",
                                             lambda: engine.stats().prefix_hit_tokens),
            "llmc_prefix_cache_hit_rate": ("Prefix cache hits / prompt tokens looked up, since start.",
                                           lambda: engine.stats().prefix_hit_rate),
            "llmc_num_preemptions": ("Sequences preempted (blocks given back, recomputed later) since start.",
                                     lambda: engine.stats().preemptions),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, labels, registry=r).labels(model_name).set_function(fn)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)  # type: ignore[return-value]

        self.ttft = hist("llmc_time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = hist("llmc_inter_token_latency_seconds", "Time between engine steps of a request.", _TOKEN)
        self.tpot = hist("llmc_time_per_output_token_seconds", "Mean time per output token after the first.", _TOKEN)
        self.e2e = hist("llmc_e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST)
        self.queue = hist("llmc_request_queue_time_seconds", "Time a request waited for a KV slot.", _REQUEST)
        self.prompt_tokens = Counter("llmc_prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("llmc_generation_tokens", "Tokens generated.", labels,
                                         registry=r).labels(model_name)
        self.success = Counter("llmc_request_success", "Finished sequences by finish reason.",
                               ["model_name", "finished_reason"], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Timing of one HTTP request (one or more engine requests), observed into the metrics when it ends."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.arrival = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.steps = 0  # engine steps that brought tokens (n > 1 completions share a step)
        self.done = False

    def on_update(self, u: StreamUpdate) -> None:
        if u.token_ids:
            self.tokens += len(u.token_ids)
            if self.first is None:
                self.first, self.steps = u.time, 1
                self.m.ttft.observe(u.time - self.arrival)
            elif self.last is not None and u.time > self.last:
                self.m.itl.observe(u.time - self.last)
                self.steps += 1
            self.last = u.time
        if u.finish_reason is not None:
            self.m.success.labels(self.m.model_name, u.finish_reason.value).inc()

    def finish(self, prompt_tokens: int, scheduled: float | None, aborted: int = 0) -> None:
        """Observe the request's totals once (idempotent); `aborted` sequences ended without a final update
        (the client went away)."""
        if self.done:
            return
        self.done = True
        if aborted:
            self.m.success.labels(self.m.model_name, "abort").inc(aborted)
        now = time.monotonic()
        self.m.e2e.observe(now - self.arrival)
        if scheduled is not None:
            self.m.queue.observe(max(0.0, scheduled - self.arrival))
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.generation_tokens.inc(self.tokens)
        if self.first is not None and self.last is not None and self.steps > 1:
            self.m.tpot.observe((self.last - self.first) / (self.steps - 1))
