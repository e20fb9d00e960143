"""64 concurrent streaming chat requests: all complete with the right token counts, the KV cache empties,
and /metrics agrees with what was sent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

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
    config = ServeConfig(model_name=model, max_running=16, max_queue=64, threads=0)
    server = Server(LLM(engine_dir, config.llm_config()), config)
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
