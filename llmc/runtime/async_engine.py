"""An `EngineLoop` driven by one background thread, with asyncio streams per request.

The loop is not thread-safe: only the engine thread touches it. Other threads hand it commands (add, abort)
through a locked list and a condition; the thread sleeps on the condition when there is no work. Each request's
updates go back to the asyncio loop that submitted it with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from llmc.errors import EngineError, InputError, LlmcError
from llmc.runtime.generator import EngineLoop, LoopStats, SeqUpdate
from llmc.runtime.request import FinishReason, SamplingParams

log = logging.getLogger("llmc.serve")


class OverloadedError(LlmcError):
    """Too many requests in flight (running + queued); the client should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(OverloadedError):
    """The engine is draining for shutdown and takes no new requests."""


@dataclass(frozen=True)
class AsyncEngineConfig:
    max_queue: int = 64  # sequences waiting for a KV slot, beyond the running ones
    retry_after_s: float = 1.0  # what an overloaded client is told to wait

    def __post_init__(self) -> None:
        if not isinstance(self.max_queue, int) or isinstance(self.max_queue, bool) or self.max_queue < 0:
            raise InputError(f"--max-queue must be an integer >= 0, got {self.max_queue!r}", "max_queue")
        r = self.retry_after_s
        if not isinstance(r, int | float) or isinstance(r, bool) or not math.isfinite(r) or r < 0:
            raise InputError(f"retry_after_s must be a finite number >= 0, got {r!r}", "retry_after_s")


@dataclass(frozen=True)
class StreamUpdate(SeqUpdate):
    """A `SeqUpdate` plus when the engine produced it (monotonic seconds) and how many of its prompt's tokens
    came from the prefix cache."""

    time: float = 0.0
    cached_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    running: int  # sequences holding a KV slot
    waiting: int  # sequences admitted but not yet holding a slot
    kv_used_tokens: int
    kv_capacity_tokens: int
    kv_blocks_used: int = 0  # held by running sequences
    kv_blocks_cached: int = 0  # held by none, kept for prefix reuse
    kv_blocks_total: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache since start
    prefix_hit_tokens: int = 0  # of those, found there (not computed)
    preemptions: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


_DONE = object()  # end of a request's stream


class RequestStream:
    """The updates of one request, in order; iteration ends after every sequence has finished.

    `close()` aborts the request if it is still running (a client that went away); it is idempotent.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrival = time.monotonic()
        self.scheduled: float | None = None  # set by the engine thread when a sequence first gets a slot
        self.ended: set[int] = set()  # engine thread: sequences whose final update went out
        self.finished = False
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()

    def __aiter__(self) -> AsyncIterator[StreamUpdate]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamUpdate]:
        while True:
            item = await self._queue.get()
            if item is _DONE:
                self.finished = True
                return
            for update in item:  # type: ignore[attr-defined]
                yield update

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    def _deliver(self, item: object) -> bool:
        """Called from the engine thread; False when the request's event loop is gone."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            return True
        except RuntimeError:  # the event loop was closed
            return False


class AsyncEngine:
    """Thread-safe front of an `EngineLoop`: bounded admission, per-request async streams, abort, drain."""

    def __init__(self, loop: EngineLoop, config: AsyncEngineConfig | None = None) -> None:
        self.loop = loop
        self.config = config or AsyncEngineConfig()
        self.capacity = loop.max_running + self.config.max_queue
        self._cond = threading.Condition()
        self._commands: list[tuple[str, object]] = []  # ("add", RequestStream) | ("abort", request_id)
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._in_flight = 0  # sequences accepted and not finished; under _cond
        self._accepting = True
        self._stopping = False
        self._ids = itertools.count()
        self._stats = _engine_stats(self.loop.stats())
        self._thread = threading.Thread(target=self._run, name="llmc-engine", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.loop.max_len

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Validate and queue a request (call from a running event loop); iterate the result for its updates.

        Raises `InputError`/`LimitError` for a bad request, `OverloadedError` when running + queued sequences
        would exceed `max_running + max_queue`, `ShuttingDownError` while draining.
        """
        self.loop.check_request(prompt_ids, params)  # reads only immutable engine facts: safe here
        if params.n > self.capacity:
            raise InputError(f"n must be <= {self.capacity} (max running + max queue), got {params.n}", "n")
        with self._cond:
            if not self._thread.is_alive() and not self._stopping:
                raise EngineError("the engine thread has stopped (see the server log); restart the server")
            if not self._accepting:
                raise ShuttingDownError("the server is shutting down", self.config.retry_after_s)
            if self._in_flight + params.n > self.capacity:
                raise OverloadedError(
                    f"server overloaded: {self._in_flight} sequences in flight, the limit is {self.capacity} "
                    f"(max running {self.loop.max_running} + max queue {self.config.max_queue})",
                    self.config.retry_after_s)
            self._in_flight += params.n
            stream = RequestStream(self, f"req-{next(self._ids)}", list(prompt_ids), params)
            self._commands.append(("add", stream))
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV slot (at the engine thread's next iteration)."""
        with self._cond:
            self._commands.append(("abort", request_id))
            self._cond.notify()

    def stats(self) -> EngineStats:
        s = self._stats
        with self._cond:
            waiting = max(0, self._in_flight - s.running)
        return replace(s, waiting=waiting)

    async def shutdown(self, timeout: float) -> bool:
        """Refuse new requests, wait up to `timeout` s for those in flight, abort the rest, stop the thread.

        Returns whether everything in flight finished in time.
        """
        with self._cond:
            self._accepting = False
        deadline = time.monotonic() + timeout
        while self._in_flight and time.monotonic() < deadline and self.alive:
            await asyncio.sleep(0.02)
        drained = self._in_flight == 0
        await asyncio.to_thread(self.stop)
        return drained

    def stop(self) -> None:
        """Abort whatever is in flight and join the engine thread (blocking)."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    # -- engine thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # a bug outside a step: fail everything in flight rather than hang it
            log.exception("the engine thread crashed")
            with self._cond:
                self._accepting = False
            for stream in list(self._streams.values()):
                stream._deliver([StreamUpdate(stream.request_id, i, "", [], FinishReason.ERROR, [], time=time.monotonic())
                                 for i in range(stream.params.n) if i not in stream.ended])
                stream._deliver(_DONE)
            raise

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._commands or self.loop.has_work or self._stopping):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            self._apply(commands)
            if stopping:
                for rid in list(self._streams):
                    self._end(rid, FinishReason.ABORT)
                self._publish()
                return
            if self.loop.has_work:
                self._step()
            self._publish()

    def _apply(self, commands: list[tuple[str, object]]) -> None:
        for kind, arg in commands:
            if kind == "add":
                assert isinstance(arg, RequestStream)
                self._streams[arg.request_id] = arg
                try:
                    self.loop.add_request(arg.prompt_ids, arg.params, request_id=arg.request_id)
                except LlmcError as e:  # validated on submit; only a changed loop gets here
                    log.error("request %s refused by the engine loop: %s", arg.request_id, e)
                    self._end(arg.request_id, FinishReason.ERROR)
            elif arg in self._streams:
                self._end(str(arg), FinishReason.ABORT)

    def _step(self) -> None:
        started = time.monotonic()
        try:
            updates = self.loop.step()
        except Exception:  # a bug or an unexpected engine fault: fail the requests in the batch, keep serving
            log.exception("engine step failed; failing the running requests")
            for rid in self.loop.running_requests():
                if rid in self._streams:
                    self._end(rid, FinishReason.ERROR)
            self._release_leftovers()
            return
        self._mark_scheduled(started)
        self._dispatch(updates, started, time.monotonic())

    def _mark_scheduled(self, step_start: float) -> None:
        for rid in self.loop.running_requests():
            stream = self._streams.get(rid)
            if stream is not None and stream.scheduled is None:
                stream.scheduled = step_start

    def _dispatch(self, updates: list[SeqUpdate], step_start: float, now: float) -> None:
        self._publish()  # before any stream ends: a finished request is already out of the stats
        by_request: dict[str, list[StreamUpdate]] = {}
        for u in updates:
            if u.request_id not in self._streams or not self.loop.has_request(u.request_id):
                continue  # aborted meanwhile
            if u.finish_reason is not None:
                self._streams[u.request_id].ended.add(u.index)
            by_request.setdefault(u.request_id, []).append(
                StreamUpdate(u.request_id, u.index, u.text, u.token_ids, u.finish_reason, u.logprobs, u.error, now,
                             self.loop.requests[u.request_id][u.index].cached_tokens))
        for rid, items in by_request.items():
            stream = self._streams[rid]
            if stream.scheduled is None:  # admitted and finished within this one step
                stream.scheduled = step_start
            if not stream._deliver(items):
                self._end(rid, FinishReason.ABORT)
            elif self.loop.is_done(rid):
                self._forget(rid)
                stream._deliver(_DONE)

    def _end(self, rid: str, reason: FinishReason) -> None:
        """Stop a request from outside the step (abort, failure). Every sequence whose end was not sent yet
        gets a final update: its own finish reason if it has one (an engine error), else `reason`."""
        own = self.loop.finish_reasons(rid)
        self.loop.abort(rid)
        stream = self._forget(rid)
        self._publish()
        now = time.monotonic()
        stream._deliver([StreamUpdate(rid, i, "", [], own.get(i) or reason, [], time=now)
                         for i in range(stream.params.n) if i not in stream.ended])
        stream._deliver(_DONE)

    def _forget(self, rid: str) -> RequestStream:
        stream = self._streams.pop(rid)
        self.loop.forget(rid)
        with self._cond:
            self._in_flight -= stream.params.n
        return stream

    def _release_leftovers(self) -> None:
        """After a failed step, sequences already marked finished may still hold slots; free them."""
        self.loop.release_finished()

    def _publish(self) -> None:
        self._stats = _engine_stats(self.loop.stats())


def _engine_stats(s: LoopStats) -> EngineStats:
    return EngineStats(s.running, s.waiting, s.kv_used_tokens, s.kv_capacity_tokens, s.kv_blocks_used,
                       s.kv_blocks_cached, s.kv_blocks_total, s.prefix_queried_tokens, s.prefix_hit_tokens,
                       s.preemptions)
