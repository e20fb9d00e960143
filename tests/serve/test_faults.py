"""Faults from SERVING.md: disconnects, overload, engine errors, draining on shutdown."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from llmc.runtime.config import RuntimeConfig
from llmc.serve.app import ServeConfig

from .conftest import MODEL, Server, ServerFactory, fail_prefill_on, slow_down

LONG = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
MARKER = 319  # a token id no test prompt below contains: its prefill fails


def slow(seconds: float) -> Any:
    return lambda llm: slow_down(llm, seconds)


def test_client_disconnect_aborts_the_request_and_frees_its_slot(start_server: ServerFactory) -> None:
    server = start_server(setup=slow(0.02))  # 200 tokens take >= 4 s
    started = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 2:
                break
        assert server.engine.stats().running == 1
    server.wait_idle(timeout=2.0)
    assert time.monotonic() - started < 3.0, "the request ran on after the client left"
    m = server.metrics()
    assert m["llmc_num_requests_running"] == 0 and m["llmc_kv_cache_usage_perc"] == 0
    assert m['llmc_request_success_total{finished_reason="abort"}'] == 1
    ok = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3)  # still serving
    assert ok.usage.completion_tokens >= 1


def test_client_gone_during_a_non_streaming_request_aborts_it(start_server: ServerFactory) -> None:
    server = start_server(setup=slow(0.02))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**LONG, "stream": False}, timeout=0.5)
    server.wait_idle(timeout=2.0)
    assert server.metrics()['llmc_request_success_total{finished_reason="abort"}'] == 1


def test_overload_answers_429_with_retry_after(start_server: ServerFactory) -> None:
    config = ServeConfig(model_name=MODEL, max_queue=1, retry_after_s=2, runtime=RuntimeConfig(max_running=1, threads=1))
    server = start_server(config, setup=slow(0.01))

    async def one(client: httpx.AsyncClient) -> tuple[int, str | None, str]:
        async with client.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 60}) as r:
            body = (await r.aread()).decode()
            return r.status_code, r.headers.get("retry-after"), body

    async def run() -> list[tuple[int, str | None, str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(4)))

    results = asyncio.run(run())
    statuses = sorted(s for s, _, _ in results)
    assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
    for status, retry_after, body in results:
        if status == 429:  # refused at once, with the OpenAI error body
            assert retry_after == "2" and json.loads(body)["error"]["code"] == "overloaded", body
        else:  # admitted: streamed to the end
            assert body.rstrip().endswith("data: [DONE]"), body[-200:]
    server.wait_idle()


def test_openai_client_sees_rate_limit_error(start_server: ServerFactory) -> None:
    config = ServeConfig(model_name=MODEL, max_queue=0, runtime=RuntimeConfig(max_running=1, threads=1))
    server = start_server(config, setup=slow(0.02))
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG) as r:
        lines = r.iter_lines()  # kept: a dropped line iterator closes the stream (and the server aborts)
        next(line for line in lines if line.startswith("data: "))
        with pytest.raises(openai.RateLimitError) as e:
            server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.response.headers["retry-after"] == "1"
    server.wait_idle()


def _stream_in_thread(server: Server, body: dict[str, Any], first: threading.Event) -> dict[str, Any]:
    """Stream `body` in a thread; the result dict gets 'chunks', 'done' and 'usage' when it ends."""
    out: dict[str, Any] = {"chunks": 0, "done": False, "usage": None, "finish": None, "error": None}

    def run() -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        out["chunks"] += 1
                        out["usage"] = chunk.get("usage") or out["usage"]
                        for c in chunk.get("choices", []):
                            out["finish"] = c.get("finish_reason") or out["finish"]
                        first.set()
        except httpx.HTTPError as e:  # the server cut the stream
            out["error"] = e

    out["thread"] = threading.Thread(target=run)
    out["thread"].start()
    return out


@pytest.mark.parametrize("exc", ["EngineError", "RuntimeError"])
def test_engine_error_fails_only_that_request(start_server: ServerFactory, exc: str) -> None:
    from llmc.errors import EngineError

    error = EngineError if exc == "EngineError" else RuntimeError
    server = start_server(setup=lambda llm: (slow_down(llm, 0.01), fail_prefill_on(llm, MARKER, error)))
    assert MARKER not in server.llm.encode("Hello")
    first = threading.Event()
    other = _stream_in_thread(server, {**LONG, "max_tokens": 100, "stream_options": {"include_usage": True}},
                              first)
    assert first.wait(10)
    client = server.client()
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt=[5, MARKER, 5], max_tokens=5)
    with pytest.raises(openai.APIError):  # streaming: an error event after the 200, raised while reading
        list(client.completions.create(model=MODEL, prompt=[5, MARKER, 5], max_tokens=5, stream=True))
    other["thread"].join(30)
    if exc == "EngineError":  # the loop retries a failed batch row by row: the other request is untouched
        assert other["done"] and other["finish"] == "length" and other["usage"]["completion_tokens"] == 100
    after = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 4
    server.wait_idle()
    assert server.metrics()['llmc_request_success_total{finished_reason="error"}'] >= 2


def test_shutdown_drains_in_flight_requests_and_refuses_new_ones(start_server: ServerFactory) -> None:
    server = start_server(setup=slow(0.01))
    first = threading.Event()
    body = {**LONG, "max_tokens": 150, "stream_options": {"include_usage": True}}
    result = _stream_in_thread(server, body, first)
    assert first.wait(10)
    server.server.should_exit = True  # what uvicorn's SIGTERM handler does
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):
        httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=2)
    result["thread"].join(30)
    assert result["done"] and result["finish"] == "length" and result["usage"]["completion_tokens"] == 150
    server.thread.join(30)
    assert not server.thread.is_alive() and not server.engine.alive


def test_shutdown_timeout_aborts_what_is_left_and_frees_the_slots(start_server: ServerFactory) -> None:
    config = ServeConfig(model_name=MODEL, max_queue=4, shutdown_timeout=1, runtime=RuntimeConfig(max_running=4, threads=1))
    server = start_server(config, setup=slow(0.02))  # 200 tokens: >= 4 s, past the 1 s drain
    first = threading.Event()
    result = _stream_in_thread(server, LONG, first)
    assert first.wait(10)
    started = time.monotonic()
    server.server.should_exit = True
    server.thread.join(20)
    assert not server.thread.is_alive() and time.monotonic() - started < 4
    result["thread"].join(10)
    assert not result["done"] and result["error"] is not None  # cut off, not completed
    assert not server.engine.alive
    assert int(server.engine.loop.kv.lengths.sum()) == 0 and not server.engine.loop.has_work
