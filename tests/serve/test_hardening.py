"""One bad request never hurts another: values the sampler cannot carry, text that is not text, faults after the
engine step, large bodies, requests that can never fit, unreadable content parts, and the API key."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import httpx
import openai
import pytest

from llmc.runtime.config import RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.serve.app import ServeConfig

from .conftest import MODEL, Server, ServerFactory, slow_down
from .test_bad_input import assert_error, post
from .test_faults import LONG, _stream_in_thread

CHAT = [{"role": "user", "content": "hi"}]


def _beside(server: Server, poison: Any, tokens: int = 60) -> dict[str, Any]:
    """Run `poison()` while a long stream runs; return the stream's result once it has ended."""
    first = threading.Event()
    other = _stream_in_thread(server, {**LONG, "max_tokens": tokens, "stream_options": {"include_usage": True}},
                              first)
    assert first.wait(10)
    poison()
    other["thread"].join(30)
    return other


def _full_length(result: dict[str, Any], tokens: int = 60) -> bool:
    return bool(result["done"] and result["finish"] == "length" and result["usage"]["completion_tokens"] == tokens)


# -- sampler numerics -------------------------------------------------------------------------------------------

def test_a_tiny_temperature_is_greedy_and_hurts_no_one(start_server: ServerFactory) -> None:
    server = start_server(setup=lambda llm: slow_down(llm, 0.01))
    client = server.client()
    got: list[Any] = []

    def poison() -> None:
        for t in (1e-50, 5e-324, 1e-6):
            got.append(client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=t,
                                                 extra_body={"ignore_eos": True}))

    assert _full_length(_beside(server, poison))
    greedy = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert all(r.choices[0].text == greedy.choices[0].text for r in got)


@pytest.mark.parametrize("value", [1e-40, 1e30])
def test_a_repetition_penalty_float32_cannot_carry_is_400_naming_the_limit(start_server: ServerFactory,
                                                                           value: float) -> None:
    server = start_server(setup=lambda llm: slow_down(llm, 0.01))
    answers: list[httpx.Response] = []

    def poison() -> None:
        for path, body in (("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": CHAT})):
            answers.append(post(server, path, {"model": MODEL, **body, "repetition_penalty": value}))

    assert _full_length(_beside(server, poison))
    for r in answers:
        assert_error(r, 400, "repetition_penalty", "[0.01, 100]", param="repetition_penalty")


# -- a fault after the engine step ends only its own request ------------------------------------------------------

MARKER = 319  # a token id the other test prompts do not contain


class _FailingDetok:
    def step(self, token_id: int) -> str:
        raise ValueError("injected detokenizer fault")


def _detok_fails_on_marker(llm: LLM) -> None:
    """Sequences whose prompt holds MARKER get a detokenizer that raises on their first token."""
    slow_down(llm, 0.01)
    decode_stream = llm.tokenizer.decode_stream

    def failing(prompt_ids: Any = (), skip_special_tokens: bool = True) -> Any:
        if MARKER in prompt_ids:
            return _FailingDetok()
        return decode_stream(prompt_ids, skip_special_tokens=skip_special_tokens)

    llm.tokenizer.decode_stream = failing  # type: ignore[method-assign]


def test_a_detokenizer_fault_fails_only_its_request(start_server: ServerFactory) -> None:
    server = start_server(setup=_detok_fails_on_marker)
    assert MARKER not in server.llm.encode("Hello")
    client = server.client()
    errors: list[Exception] = []

    def poison() -> None:
        for stream in (False, True):
            try:
                r = client.completions.create(model=MODEL, prompt=[5, 6, MARKER], max_tokens=5, stream=stream)
                list(r) if stream else None
            except openai.APIError as e:
                errors.append(e)

    assert _full_length(_beside(server, poison))
    assert len(errors) == 2 and isinstance(errors[0], openai.InternalServerError)
    server.wait_idle()
    assert server.metrics()['llmc_request_success_total{finished_reason="error"}'] == 2


# -- text that is not text; exceptions that escape a route ------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "\\udfff", "content": "hi"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages"),
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "x\\udbff"]}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
])
def test_a_lone_surrogate_is_a_json_400_naming_the_field(server: Server, path: str, body: str, param: str) -> None:
    r = post(server, path, body.encode())
    err = assert_error(r, 400, "surrogate", param=param)
    assert err["message"].startswith(param)


def test_an_exception_that_escapes_a_route_is_a_json_500_with_the_request_id(
        start_server: ServerFactory, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("a bug")

    server = start_server()
    server.app.state.served.tokenizer.apply_chat_template = broken
    with caplog.at_level(logging.ERROR, logger="llmc.serve"):
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT})
        assert_error(r, 500, "internal error", "RuntimeError")
        rid = r.headers["x-request-id"]
        assert rid in r.json()["error"]["message"]
        mine = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT},
                          headers={"X-Request-Id": "client-id-7"})
        assert mine.status_code == 500 and mine.headers["x-request-id"] == "client-id-7"
    assert rid in caplog.text and "client-id-7" in caplog.text and "a bug" in caplog.text
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


def _stream_ending_in(server: Any, token_text: Any) -> tuple[dict[str, Any], httpx.Response]:
    """Stream a completion with logprobs whose token text comes from `token_text` (raising after the 200 went
    out); the error event the stream ended with, and the response."""
    server.app.state.served.token_text = token_text
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "logprobs": 1, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    return json.loads(lines[-2][6:])["error"], r


def test_a_fault_after_the_stream_started_ends_it_with_an_error_event(start_server: ServerFactory) -> None:
    server = start_server()

    def broken(token_id: int) -> str:
        raise RuntimeError("logprob text bug")

    err, r = _stream_ending_in(server, broken)
    assert err["code"] == "internal_error" and r.headers["x-request-id"] in err["message"]
    server.wait_idle()


def test_a_late_refusal_in_a_stream_keeps_its_own_status(start_server: ServerFactory) -> None:
    """A refusal that arrives after the 200 went out (Ray Serve's back-pressure when every replica is full) ends the
    stream with its own error, 429 overloaded with the retry hint in the message, not an internal error."""
    from llmc.runtime.async_engine import OverloadedError

    server = start_server()

    def full(token_id: int) -> str:
        raise OverloadedError("server overloaded: every engine replica is busy", 2.0)

    err, _ = _stream_ending_in(server, full)
    assert err["code"] == "overloaded" and "every engine replica is busy" in err["message"]
    server.wait_idle()


# -- large bodies ------------------------------------------------------------------------------------------------

def test_a_body_over_the_limit_is_413(start_server: ServerFactory) -> None:
    server = start_server(ServeConfig(model_name=MODEL, max_request_bytes=4096, runtime=RuntimeConfig(max_running=2, threads=1)))
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert_error(r, 413, "4096", "--max-request-bytes")

    def chunks() -> Any:  # no Content-Length: counted as it is read
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, "4096")
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


_LARGE_REQUESTS_CLIENT = """
import asyncio, json, sys, time
import httpx

url, n = sys.argv[1], int(sys.argv[2])
big = "hello world, this is a long message. " * 50_000  # 1.85 MB: under the limit, over the context
latencies, statuses = [], []

async def main():
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def large():
            r = await client.post("/v1/chat/completions",
                                  json={"model": "tiny", "messages": [{"role": "user", "content": big}]})
            statuses.append(r.status_code)

        async def health():
            await asyncio.sleep(0.05)
            while len(statuses) < n:
                start = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.01)

        await asyncio.gather(*(large() for _ in range(n)), health())

asyncio.run(main())
print(json.dumps({"latencies": latencies, "statuses": statuses}))
"""


def test_health_stays_fast_while_large_requests_are_tokenized(start_server: ServerFactory) -> None:
    """The client runs in its own process, as a real one does (in this one it would share the server's GIL)."""
    import subprocess
    import sys

    server = start_server(ServeConfig(model_name=MODEL, runtime=RuntimeConfig(max_running=4, threads=1)))
    out = subprocess.run([sys.executable, "-c", _LARGE_REQUESTS_CLIENT, server.url, "4"], capture_output=True,
                         text=True, timeout=300, check=True)
    result = json.loads(out.stdout)
    assert result["statuses"] == [400] * 4  # too long for the context, found after tokenizing
    latencies = sorted(result["latencies"])
    assert len(latencies) >= 20, latencies
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    assert p99 < 0.1, f"/health p99 {p99 * 1000:.0f} ms over {len(latencies)} probes"


# -- content the model cannot read; requests that can never fit ---------------------------------------------------

@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_a_content_part_the_model_cannot_read_is_400_naming_its_type(server: Server, part: dict[str, Any]) -> None:
    content = [{"type": "text", "text": "What is in this picture?"}, part]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert_error(r, 400, "messages.0.content.1", repr(part["type"]), "text only", param="messages")


def test_a_request_that_can_never_fit_is_400_not_429(server: Server) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ["Hi"] * 100, "max_tokens": 2})
    assert_error(r, 400, "100 sequences", "100 prompts", "at most 20", "max running 4", "max queue 16",
                 param="prompt")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": ["Hi"] * 7, "n": 3, "max_tokens": 2})
    assert_error(r, 400, "21 sequences", "7 prompts x n=3")
    ok = post(server, "/v1/completions", {"model": MODEL, "prompt": ["Hi"] * 5, "n": 4, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 20
    server.wait_idle()


# -- the API key, /metrics, CORS ------------------------------------------------------------------------------------

KEY = "sk-llmc-test-0123456789"


def test_the_api_key_is_required_on_v1_and_the_openai_client_works_with_it(start_server: ServerFactory) -> None:
    server = start_server(ServeConfig(model_name=MODEL, api_key=KEY, runtime=RuntimeConfig(max_running=2, threads=1)))
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).usage.completion_tokens >= 1
    assert [m.id for m in good.models.list()] == [MODEL]
    for wrong in ("unused", KEY[:-1], KEY + "x"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key=wrong, max_retries=0).models.list()
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    err = assert_error(r, 401, "no API key", "Bearer")
    assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200  # open unless asked


def test_metrics_behind_the_key_when_asked(start_server: ServerFactory) -> None:
    server = start_server(ServeConfig(model_name=MODEL, api_key=KEY, protect_metrics=True, runtime=RuntimeConfig(max_running=2, threads=1)))
    assert httpx.get(server.url + "/metrics").status_code == 401
    ok = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and "llmc_num_requests_running" in ok.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_cors_is_off_unless_origins_are_named(server: Server, start_server: ServerFactory) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    cors = start_server(ServeConfig(model_name=MODEL, api_key=KEY, allowed_origins=("https://app.example",), runtime=RuntimeConfig(max_running=2, threads=1)))
    r = httpx.options(cors.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(cors.url + "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert r.headers.get("access-control-allow-origin") != "https://evil.example"


def test_a_chat_template_that_raises_is_a_400_naming_it(start_server: ServerFactory, tmp_path: Any) -> None:
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}")
    server = start_server(ServeConfig(model_name=MODEL, runtime=RuntimeConfig(max_running=2, threads=1, chat_template=str(template))))
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT})
    assert_error(r, 400, str(template), "TypeError")
