"""The ingress's stand-in for an `AsyncEngine`: the same surface the server's endpoints use, over Ray Serve
engine replicas reached through a `DeploymentHandle` (Ray's router picks the replica of each request).

Requests are checked here exactly as an engine checks them (`EngineLoop.check_request`, on facts the replicas
reported), so a bad request is a 400 before it travels; a replica that dies mid-request ends that request's
sequences with an `error` update (a clean error for the client) while the others go on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from llmc.errors import EngineError, InputError
from llmc.runtime.async_engine import (
    AsyncEngineConfig,
    EngineStats,
    OverloadedError,
    ShuttingDownError,
    StreamUpdate,
)
from llmc.runtime.generator import EngineLoop
from llmc.runtime.request import FinishReason, SamplingParams
from llmc.runtime.structured import GrammarCompiler
from llmc.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineFacts:
    """What one engine replica reports of itself (all replicas load the same engine folder)."""

    max_model_len: int
    max_running: int
    max_queue: int
    vocab_size: int
    logits_size: int  # (the ids the model can produce: fewer where its head is pruned)
    eos_ids: tuple[int, ...]
    kv_capacity_tokens: int


def raise_remote_error(kind: str, message: str, param: str | None, retry_after: float) -> None:
    """Re-raise, at the ingress, an error a replica refused a request with (sent as plain values)."""
    if kind == "shutting_down":
        raise ShuttingDownError(message, retry_after)
    if kind == "overloaded":
        raise OverloadedError(message, retry_after)
    if kind == "input":
        raise InputError(message, param)
    raise EngineError(message)


class _Vocab:
    def __init__(self, vocab_size: int, logits_size: int) -> None:
        self.vocab_size, self.logits_size = vocab_size, logits_size


class RemoteLoop:
    """The engine facts `EngineLoop.check_request` reads, for the same checks without an engine."""

    def __init__(self, facts: EngineFacts, tokenizer: Tokenizer) -> None:
        self.engine = _Vocab(facts.vocab_size, facts.logits_size)
        self.max_len = facts.max_model_len
        self.max_running = facts.max_running
        self.tokenizer = tokenizer
        self.eos_ids = list(facts.eos_ids)
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.engine.logits_size, self.eos_ids,
                                            self.tokenizer.vocab_size)
        return self._grammars

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        EngineLoop.check_request(self, prompt_ids, params)  # type: ignore[arg-type]  # duck-typed: same checks


class ReplicaMetrics:
    """Per-replica counters, as the ingress saw each replica serve (labels: the replica's Ray Serve id)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("llmc_replica_requests", "Requests an engine replica started.", ["replica"],
                                registry=registry)
        self.tokens = Counter("llmc_replica_generation_tokens", "Tokens an engine replica generated.",
                              ["replica"], registry=registry)
        self.failures = Counter("llmc_replica_failures", "Requests that failed on an engine replica (died, "
                                "refused).", ["replica"], registry=registry)


class RemoteStream:
    """One request's updates from the replica serving it; `close()` cancels it there (frees its KV slot)."""

    def __init__(self, engine: RemoteEngine, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine, self.params = engine, params
        self.scheduled: float | None = None
        self.finished = False
        self.replica: str | None = None
        self._response = engine.handle.generate.options(stream=True).remote(prompt_ids, params)
        self._ended: set[int] = set()
        self._released = False

    def __aiter__(self) -> AsyncIterator[StreamUpdate]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamUpdate]:
        from ray.exceptions import RayError
        from ray.serve.exceptions import BackPressureError

        try:
            async for kind, value in self._response:
                if kind == "start":
                    self.replica = value
                    self.engine.metrics.requests.labels(value).inc()
                elif kind == "error":
                    self._failed()
                    raise_remote_error(*value)
                else:
                    yield self._update(value)
        except BackPressureError as e:
            raise OverloadedError(f"server overloaded: every engine replica is busy and {e}",
                                  self.engine.retry_after_s) from None
        except RayError:  # the replica died (or was cancelled under us): end what is left with an error
            self._failed()
            now = time.monotonic()
            for i in range(self.params.n):
                if i not in self._ended:
                    yield StreamUpdate("", i, "", [], FinishReason.ERROR, [], time=now)
        finally:
            self.finished = True
            self._release()

    def _update(self, u: StreamUpdate) -> StreamUpdate:
        now = time.monotonic()  # the replica's clock is another machine's: re-stamp on arrival
        if self.scheduled is None:
            self.scheduled = now
        if u.finish_reason is not None:
            self._ended.add(u.index)
        if u.token_ids and self.replica is not None:
            self.engine.metrics.tokens.labels(self.replica).inc(len(u.token_ids))
        return dataclasses.replace(u, time=now)

    def _failed(self) -> None:
        if self.replica is not None:
            self.engine.metrics.failures.labels(self.replica).inc()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.engine.release(self.params.n)

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._response.cancel()
        self._release()


class RemoteEngine:
    """What `llmc.serve`'s endpoints use of an `AsyncEngine`, over a deployment of engine replicas."""

    def __init__(self, handle: Any, facts: EngineFacts, tokenizer: Tokenizer, retry_after_s: float = 1.0) -> None:
        self.handle = handle
        self.loop = RemoteLoop(facts, tokenizer)
        self.config = AsyncEngineConfig(facts.max_queue, retry_after_s)
        self.capacity = facts.max_running + facts.max_queue  # one request's sequences run on one replica
        self.retry_after_s = retry_after_s
        self.metrics = ReplicaMetrics(CollectorRegistry())  # the app puts them in the server's registry
        self._kv_capacity = facts.kv_capacity_tokens
        self._in_flight = 0
        self._accepting = True

    @property
    def max_model_len(self) -> int:
        return self.loop.max_len

    @property
    def alive(self) -> bool:
        return True  # Ray Serve health-checks and restarts the replicas; the ingress itself has no thread

    @property
    def accepting(self) -> bool:
        return self._accepting

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> RemoteStream:
        self.loop.check_request(prompt_ids, params)
        if params.n > self.capacity:
            raise InputError(f"n must be <= {self.capacity} (max running + max queue of a replica), got {params.n}",
                             "n")
        if not self._accepting:
            raise ShuttingDownError("the server is shutting down", self.retry_after_s)
        self._in_flight += params.n
        return RemoteStream(self, list(prompt_ids), params)

    def release(self, n: int) -> None:
        self._in_flight -= n

    def stats(self) -> EngineStats:
        """Sequences in flight through this ingress (the replicas' KV use is in their own stats)."""
        return EngineStats(self._in_flight, 0, 0, self._kv_capacity)

    async def shutdown(self, timeout: float) -> bool:
        self._accepting = False
        return True
