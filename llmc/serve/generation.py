"""One HTTP request's generation: its engine requests (one per prompt), their merged updates, and their end.

Choice `i * n + k` is completion k of prompt i, as OpenAI numbers the choices of a batched /v1/completions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from llmc.errors import InputError
from llmc.runtime.async_engine import AsyncEngine, RequestStream, StreamUpdate
from llmc.runtime.request import FinishReason, SamplingParams, TokenLogprob
from llmc.serve.errors import ApiError, to_api_error
from llmc.serve.metrics import RequestTracker
from llmc.serve.sse import sse_error

log = logging.getLogger("llmc.serve")


@dataclass
class ChoiceResult:
    """A choice's output, accumulated from its updates."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: Exception | None = None  # with FinishReason.ERROR: the cause, when the runtime knows it


def failure(reason: FinishReason, error: Exception | None = None) -> ApiError:
    """The error a choice that ended with `error` or `abort` turns into: a 400 naming the field where the request
    was at fault (a constraint that failed while decoding), else a 500 or a 503."""
    if reason is FinishReason.ERROR and isinstance(error, InputError):
        return to_api_error(error)
    if reason is FinishReason.ERROR:
        return ApiError(500, "the engine failed while generating this request", code="engine_error")
    return ApiError(503, "the request was aborted: the server is shutting down", code="aborted")


class Generation:
    """The engine requests of one HTTP request. `close()` aborts what still runs and records the metrics."""

    def __init__(self, engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                 tracker: RequestTracker) -> None:
        self.n = params.n
        self.tracker = tracker
        self.streams: list[RequestStream] = []
        try:
            for ids in prompts:
                self.streams.append(engine.add_request(ids, params))
        except Exception:  # refused (overloaded, bad input): undo the ones already queued, record nothing
            self._abort()
            raise
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.num_choices = len(prompts) * self.n
        self.finished_choices = 0
        self._cached: dict[int, int] = {}  # prompt -> its tokens found in the prefix cache

    async def updates(self) -> AsyncIterator[tuple[int, StreamUpdate]]:
        """(choice index, update) pairs in arrival order; closes the generation when done or abandoned."""
        try:
            if len(self.streams) == 1:
                async for u in self.streams[0]:
                    self._count(u, 0)
                    yield u.index, u
            else:
                async for i, u in _merge(self.streams):
                    self._count(u, i)
                    yield i * self.n + u.index, u
        finally:
            self.close()

    async def collect(self, receive: Receive) -> list[ChoiceResult]:
        """Run to the end; raise the `ApiError` of the first failed choice. A client that disconnects meanwhile
        (seen on `receive`) aborts the generation."""
        results = [ChoiceResult(i) for i in range(self.num_choices)]
        done = False

        async def gather(scope: anyio.CancelScope) -> None:
            nonlocal done
            async for i, u in self.updates():
                add_update(results[i], u)
            done = True
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(gather, tg.cancel_scope)
            await _wait_disconnect(receive)
            tg.cancel_scope.cancel()
        if not done:
            self.close()
            raise ApiError(499, "client closed the request")
        for r in results:
            if r.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                raise failure(r.finish_reason, r.error)
        return results

    def _count(self, u: StreamUpdate, prompt: int) -> None:
        if u.index == 0 and u.cached_tokens:  # the prompt's first sequence: the one its usage counts
            self._cached[prompt] = u.cached_tokens
        self.tracker.on_update(u)
        if u.finish_reason is not None:
            self.finished_choices += 1

    def close(self) -> None:
        self._abort()
        scheduled = [s.scheduled for s in self.streams if s.scheduled is not None]
        self.tracker.finish(self.prompt_tokens, min(scheduled) if scheduled else None,
                            aborted=self.num_choices - self.finished_choices)

    def _abort(self) -> None:
        for s in self.streams:
            s.close()

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    @property
    def completion_tokens(self) -> int:
        return self.tracker.tokens


def add_update(result: ChoiceResult, u: StreamUpdate) -> None:
    result.text += u.text
    result.token_ids.extend(u.token_ids)
    result.logprobs.extend(u.logprobs)
    if u.finish_reason is not None:
        result.finish_reason = u.finish_reason
        result.error = u.error


async def _wait_disconnect(receive: Receive) -> None:
    """Returns when the client goes away (the body was read already: the server has nothing else to send)."""
    while (await receive())["type"] != "http.disconnect":
        await anyio.sleep(0.05)  # never spin, whatever a server answers


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamUpdate]]:
    queue: asyncio.Queue[tuple[int, StreamUpdate | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for u in stream:
            queue.put_nowait((i, u))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, u = await queue.get()
            if u is None:
                left -= 1
            else:
                yield i, u
    finally:
        for t in tasks:
            t.cancel()


class SSEResponse(StreamingResponse):
    """Server-sent events that stop (and run `on_close`) as soon as the client disconnects.

    Starlette watches for a disconnect only under ASGI < 2.4; uvicorn speaks 2.4, where a gone client is noticed
    only at the next write. Watching always frees a long request's KV slot at once.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Any], request_id: str | None = None) -> None:
        super().__init__(_guarded(content, request_id), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):  # run the generator's own cleanup now, not at garbage collection
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            self.on_close()


async def _guarded(content: AsyncIterator[str], request_id: str | None) -> AsyncIterator[str]:
    """The stream's events; a fault after the 200 went out ends it with an error event (logged with the request
    id), never with a cut connection and nothing said."""
    try:
        async for line in content:
            yield line
    except Exception as e:  # its own status where it has one (a refusal that came late, as Ray's back-pressure:
        # 429 overloaded), else an internal error, logged with the request id
        err = to_api_error(e, request_id)
        async for line in sse_error(err):
            yield line
    finally:
        aclose = getattr(content, "aclose", None)
        if aclose is not None:
            await aclose()
