"""One test per row of SERVING.md's bad-input table that a server decides (status + OpenAI error body)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from llmc.runtime.config import RuntimeConfig
from llmc.runtime.request import MAX_STOP_STRINGS
from llmc.serve.app import ServeConfig

from .conftest import MODEL, Server, ServerFactory

CHAT = [{"role": "user", "content": "hi"}]


def post(server: Server, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    return httpx.post(server.url + path, json=body)


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> dict[str, Any]:
    """The status, and an OpenAI error body whose message holds every word."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], (w, err["message"])
    if param is not None:
        assert err["param"] == param
    return err  # type: ignore[no-any-return]


def test_prompt_longer_than_the_context_names_limit_and_count(server: Server) -> None:
    ids = [5] * 300
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt=ids, max_tokens=1)
    assert "300" in str(e.value) and "256" in str(e.value)
    # truncated only when asked
    r = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                           extra_body={"truncate_prompt_tokens": 100})
    assert r.usage.prompt_tokens == 100


def test_prompt_plus_max_tokens_over_the_context_names_both_numbers(server: Server) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 200, "max_tokens": 100})
    assert_error(r, 400, "200", "100", "256")


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", -5), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("n", 0), ("min_p", 1.5),
])
def test_out_of_range_sampling_fields_name_the_field_and_the_rule(server: Server, field: str, value: Any) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = post(server, path, {"model": MODEL, **body, field: value})
        err = assert_error(r, 400, field, param=field)
        assert any(rule in err["message"] for rule in (">=", ">", "in [", "in ("))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_temperature_nan_and_inf_are_refused(server: Server, literal: bytes) -> None:
    body = b'{"model": "tiny", "prompt": "hi", "temperature": ' + literal + b"}"
    assert_error(post(server, "/v1/completions", body), 400, "temperature", param="temperature")


def test_openai_client_maps_a_bad_field_to_bad_request(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="top_p"):
        server.client().chat.completions.create(model=MODEL, messages=CHAT, top_p=2.0)


@pytest.mark.parametrize("prompt", ["", [], [[]], [""]])
def test_empty_prompt_is_refused(server: Server, prompt: Any) -> None:
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": prompt}), 400, "empty", param="prompt")


def test_empty_messages_are_refused(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert_error(r, 400, "messages", "empty", param="messages")


@pytest.mark.parametrize("token", [320, 10**9, -1])
def test_token_id_outside_the_vocabulary_is_refused(server: Server, token: int) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [1, token, 2], "max_tokens": 2})
    assert_error(r, 400, str(token), "320")
    server.wait_idle()


def test_unknown_model_is_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        server.client().chat.completions.create(model="no-such-model", messages=CHAT)
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert_error(r, 404, "gpt-4", MODEL, param="model")


def test_malformed_json_is_400_with_the_position(server: Server) -> None:
    r = post(server, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert_error(r, 400, "malformed JSON")


@pytest.mark.parametrize(("body", "path_words"), [
    ({"prompt": "hi", "max_tokens": "ten"}, ["body.max_tokens"]),
    ({"prompt": "hi", "temperature": [1]}, ["body.temperature"]),
    ({"prompt": "hi", "stream": "yes"}, ["body.stream"]),
    ({"prompt": 42}, ["body.prompt"]),
    ({"max_tokens": 3}, ["body.prompt", "required"]),
])
def test_wrong_types_are_400_with_the_field_path(server: Server, body: dict[str, Any], path_words: list[str]) -> None:
    assert_error(post(server, "/v1/completions", {"model": MODEL, **body}), 400, *path_words)


def test_wrong_type_inside_messages_names_the_path(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]})
    assert_error(r, 400, "body.messages.0.role")


def test_too_many_stop_strings(server: Server) -> None:
    stops = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": stops}), 400, "stop")


def test_top_logprobs_over_20(server: Server) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True,
                                              "top_logprobs": 21})
    assert_error(r, 400, "top_logprobs", "20", param="top_logprobs")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21})
    assert_error(r, 400, "logprobs", "20", param="logprobs")


def test_stream_options_without_stream(server: Server) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = post(server, path, {"model": MODEL, **body, "stream_options": {"include_usage": True}})
        assert_error(r, 400, "stream_options", param="stream_options")


def test_chat_without_a_template_tells_the_operator_to_pass_one(start_server: ServerFactory) -> None:
    def drop_template(llm: Any) -> None:
        llm.tokenizer.chat_template = None

    server = start_server(setup=drop_template)
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        server.client().chat.completions.create(model=MODEL, messages=CHAT)
    r = server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)  # raw prompts still work
    assert r.usage.completion_tokens >= 1


def test_n_over_capacity_is_refused_not_queued_forever(start_server: ServerFactory) -> None:
    server = start_server(ServeConfig(model_name=MODEL, max_queue=1, runtime=RuntimeConfig(max_running=1, threads=1)))
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 3}), 400,
                 "needs 3 sequences", "at most 2", param="n")


@pytest.mark.parametrize("depth", [128, 500, 956, 5000])  # 956: where checking the text overflowed the stack
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_json_nested_too_deep_is_400_naming_the_limit(server: Server, path: str, depth: int) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    head = json.dumps({"model": MODEL, "max_tokens": 2, **body})[:-1]
    deep = f'{head}, "x": {"[" * depth}{"]" * depth}}}'
    err = assert_error(post(server, path, deep.encode()), 400, "deeper than 128 levels")
    assert err["param"] in ("x", None)  # None: deeper than Python's JSON parser goes
    shallow = deep.replace("[" * depth + "]" * depth, "[" * 127 + "]" * 127)  # 128 levels with the body
    assert post(server, path, shallow.encode()).status_code == 200


@pytest.mark.parametrize(("body", "words"), [
    (b'{"prompt": "h\xffi"}', ["malformed JSON body", "utf-8", "0xff"]),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", ["malformed JSON body", "4300 digits"]),
])
def test_json_python_cannot_read_is_400_naming_why(server: Server, body: bytes, words: list[str]) -> None:
    assert_error(post(server, "/v1/completions", body), 400, *words)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_under_another_content_type_is_400_naming_it(server: Server, content_type: str) -> None:
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                   headers={"content-type": content_type})
    assert_error(r, 400, "Content-Type: application/json", repr(content_type))


@pytest.mark.parametrize("key", [" 5", "5_0", "+5", "\u0665", "5.0"])
def test_logit_bias_keys_are_token_ids_in_ascii_digits(server: Server, key: str) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                         "logit_bias": {key: 1}})
    assert_error(r, 400, "logit_bias keys must be token ids", repr(key), param="logit_bias")
