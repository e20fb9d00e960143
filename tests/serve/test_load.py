"""64 concurrent streaming chat requests: all complete with the right token counts, the KV cache empties,
and /metrics agrees with what was sent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmc.runtime.config import RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.serve.app import ServeConfig

from .conftest import Server

pytestmark = pytest.mark.slow

CONCURRENT = 64
MAX_TOKENS = 32


async def _chat(client: Any, model: str, i: int) -> tuple[int, int, int, str]:
    """(content chunks, completion tokens, prompt tokens, finish reason) of one streamed chat."""
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Request {i}: tell me a story about rivers."}],
        max_tokens=MAX_TOKENS, temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks, usage, finish = 0, None, ""
    async for chunk in stream:
        if chunk.choices:
            chunks += 1
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert usage is not None
    return chunks, usage.completion_tokens, usage.prompt_tokens, finish


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_64_concurrent_streaming_chats(model: str, request: pytest.FixtureRequest, serve_engine_dir: Path) -> None:
    engine_dir = serve_engine_dir if model == "tiny" else request.getfixturevalue("smollm2").engine_dir
    config = ServeConfig(model_name=model, max_queue=64, runtime=RuntimeConfig(max_running=16, threads=0))
    server = Server(LLM(engine_dir, config.runtime), config)
    try:
        async def run() -> list[Any]:
            client = server.async_client(timeout=600)
            return await asyncio.gather(*(_chat(client, model, i) for i in range(CONCURRENT)),
                                        return_exceptions=True)

        results = asyncio.run(run())
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert all(tokens == MAX_TOKENS and finish == "length" for _, tokens, _, finish in results)
        server.wait_idle(timeout=10)
        m = server.metrics()
        assert m['llmc_request_success_total{finished_reason="length"}'] == CONCURRENT
        assert m["llmc_generation_tokens_total"] == CONCURRENT * MAX_TOKENS
        assert m["llmc_prompt_tokens_total"] == sum(p for _, _, p, _ in results)
        assert m["llmc_e2e_request_latency_seconds_count"] == CONCURRENT
        assert m["llmc_time_to_first_token_seconds_count"] == CONCURRENT
        assert m["llmc_request_queue_time_seconds_count"] == CONCURRENT
        assert m["llmc_num_requests_running"] == 0 and m["llmc_num_requests_waiting"] == 0
        assert m["llmc_kv_cache_usage_perc"] == 0
    finally:
        server.stop()


POISON_BODIES: list[Any] = [
    b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ',  # malformed JSON
    b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}',  # not text
    {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e-40},  # float32 cannot carry it
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"prompt": ["Hi"] * 100},  # can never fit
    {"prompt": [5, 6, 319], "max_tokens": 8},  # the detokenizer fails on token 319 (injected): a 500 for it alone
    {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-50, "max_tokens": 8},  # greedy, fine
]


def test_64_streams_with_cancellations_and_poison_requests(serve_engine_dir: Path) -> None:
    """A quarter of the streams are cancelled after their first chunk and one request in ten is malformed or
    poison: every well-formed request completes with its full length, and the server ends idle."""
    from .test_hardening import _detok_fails_on_marker

    config = ServeConfig(model_name="tiny", max_queue=64, runtime=RuntimeConfig(max_running=16, threads=0))
    llm = LLM(serve_engine_dir, config.runtime)
    _detok_fails_on_marker(llm)
    server = Server(llm, config)
    kinds = ["poison" if i % 10 == 0 else "cancel" if i % 4 == 1 else "full" for i in range(CONCURRENT)]

    async def cancelled(client: Any, i: int) -> str:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Request {i}"}], max_tokens=MAX_TOKENS,
            stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()
        return "cancelled"

    async def poison(http: Any, i: int) -> int:
        body = POISON_BODIES[(i // 10) % len(POISON_BODIES)]
        path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
        r = await (http.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes)
                   else http.post(path, json={"model": "tiny", **body}))
        assert r.status_code < 500 or r.json()["error"]["code"] == "engine_error", r.text
        return r.status_code

    try:
        async def run() -> list[Any]:
            client = server.async_client(timeout=600)
            async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:
                jobs = [_chat(client, "tiny", i) if k == "full" else cancelled(client, i) if k == "cancel"
                        else poison(http, i) for i, k in enumerate(kinds)]
                return await asyncio.gather(*jobs, return_exceptions=True)

        results = asyncio.run(run())
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        full = [r for r, k in zip(results, kinds) if k == "full"]
        assert len(full) == 41 and all(tokens == MAX_TOKENS and finish == "length" for _, tokens, _, finish in full)
        statuses = sorted(r for r, k in zip(results, kinds) if k == "poison")
        assert statuses == [200, 400, 400, 400, 400, 400, 500], statuses
        server.wait_idle(timeout=10)
        m = server.metrics()
        assert m["llmc_num_requests_running"] == 0 and m["llmc_num_requests_waiting"] == 0
        assert m["llmc_kv_cache_usage_perc"] == 0
        assert m['llmc_request_success_total{finished_reason="length"}'] == 41 + 1
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
