"""AsyncEngine on its own: streams, abort, bounded admission, errors, drain, and an idle thread that sleeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from llmc.runtime.async_engine import AsyncEngine, AsyncEngineConfig, OverloadedError, ShuttingDownError
from llmc.runtime.llm import LLM, LLMConfig
from llmc.runtime.request import FinishReason, SamplingParams

from .conftest import slow_down

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def llm(serve_engine_dir: Path) -> LLM:
    return LLM(serve_engine_dir, LLMConfig(threads=1, max_running=2))


@pytest.fixture
def engine(llm: LLM) -> Iterator[AsyncEngine]:
    e = AsyncEngine(llm.loop, AsyncEngineConfig(max_queue=2))
    yield e
    e.stop()


async def _collect(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for u in engine.add_request(ids, params):
        out.setdefault(u.index, []).extend(u.token_ids)
    return out


def test_concurrent_requests_give_the_tokens_each_gives_alone(
        serve_engine_dir: Path, llm: LLM, engine: AsyncEngine) -> None:
    prompts = [llm.encode("Hello"), llm.encode("The capital of France is"), llm.encode("Once upon a time")]
    reference = LLM(serve_engine_dir, LLMConfig(threads=1, max_running=1))  # the engine owns llm's loop now
    alone = [{0: reference.generate([p], GREEDY)[0].outputs[0].token_ids} for p in prompts]

    async def run() -> list[dict[int, list[int]]]:
        return await asyncio.gather(*(_collect(engine, p, GREEDY) for p in prompts))

    assert asyncio.run(run()) == alone and all(len(r[0]) == 12 for r in alone)


def test_abort_frees_the_kv_slot(llm: LLM, engine: AsyncEngine) -> None:
    slow_down(llm, 0.01)

    async def run() -> None:
        stream = engine.add_request(llm.encode("Hello"), SamplingParams(max_tokens=200, ignore_eos=True))
        async for u in stream:
            if u.token_ids:
                break
        stream.close()

    asyncio.run(run())
    deadline = time.monotonic() + 2
    while engine.stats().running or engine.stats().kv_used_tokens:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)
    assert engine.stats().waiting == 0 and not llm.loop.requests


def test_admission_is_bounded_by_running_plus_queue(llm: LLM, engine: AsyncEngine) -> None:
    slow_down(llm, 0.005)
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    async def run() -> None:
        streams = [engine.add_request([5, 6], params) for _ in range(4)]  # 2 running + 2 queued
        assert engine.stats().waiting + engine.stats().running == 4
        with pytest.raises(OverloadedError) as e:
            engine.add_request([5, 6], params)
        assert e.value.retry_after > 0
        for s in streams:  # every admitted request still runs to its full length
            tokens = [t async for u in s for t in u.token_ids]
            assert len(tokens) == 20
        engine.add_request([5, 6], SamplingParams(max_tokens=1)).close()  # room again

    asyncio.run(run())


def test_an_exception_in_a_step_fails_the_running_requests_and_the_loop_goes_on(
        llm: LLM, engine: AsyncEngine) -> None:
    decode = llm.engine.decode
    calls = {"n": 0}

    def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return decode(*args, **kwargs)  # type: ignore[operator]

    llm.engine.decode = flaky  # type: ignore[method-assign]

    async def run() -> list[FinishReason | None]:
        reasons = []
        for _ in range(2):
            last = None
            async for u in engine.add_request([5, 6, 7], GREEDY):
                last = u.finish_reason or last
            reasons.append(last)
        return reasons

    assert asyncio.run(run()) == [FinishReason.ERROR, FinishReason.LENGTH]
    assert engine.stats().kv_used_tokens == 0


def test_shutdown_drains_then_refuses(llm: LLM, engine: AsyncEngine) -> None:
    async def run() -> tuple[bool, dict[int, list[int]]]:
        task = asyncio.create_task(_collect(engine, [5, 6], GREEDY))
        await asyncio.sleep(0)
        drained = await engine.shutdown(timeout=30)
        with pytest.raises(ShuttingDownError):
            engine.add_request([5], GREEDY)
        return drained, await task

    drained, out = asyncio.run(run())
    assert drained and len(out[0]) == 12 and not engine.alive


def test_shutdown_timeout_aborts_what_is_left(llm: LLM, engine: AsyncEngine) -> None:
    slow_down(llm, 0.02)

    async def run() -> tuple[bool, list[FinishReason | None]]:
        reasons: list[FinishReason | None] = []

        async def consume() -> None:
            async for u in engine.add_request([5, 6], SamplingParams(max_tokens=200, ignore_eos=True)):
                if u.finish_reason:
                    reasons.append(u.finish_reason)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        drained = await engine.shutdown(timeout=0.2)
        await task
        return drained, reasons

    drained, reasons = asyncio.run(run())
    assert not drained and reasons == [FinishReason.ABORT]
    assert int(llm.loop.kv.lengths.sum()) == 0


def test_idle_engine_thread_sleeps(engine: AsyncEngine) -> None:
    time.sleep(0.1)
    thread = next(t for t in psutil.Process().threads() if t.id == engine._thread.native_id)
    time.sleep(0.5)
    after = next(t for t in psutil.Process().threads() if t.id == engine._thread.native_id)
    assert (after.user_time + after.system_time) - (thread.user_time + thread.system_time) < 0.05
