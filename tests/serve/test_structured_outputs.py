"""response_format (json_object, json_schema, llmc's regex and grammar), logit_bias, stop_token_ids and logprobs,
through the Python API and the real `openai` client. The tiny model is random: valid JSON is the constraint's
doing, never chance."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llmc.runtime.config import RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.runtime.request import SamplingParams

from .conftest import MODEL, Server
from .structured_schemas import SCHEMAS

CHAT = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def llm(serve_engine_dir: Path) -> LLM:
    return LLM(serve_engine_dir, RuntimeConfig(max_running=8, threads=1))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_parses_and_validates_against_its_schema(llm: LLM, temperature: float) -> None:
    assert len(SCHEMAS) >= 30
    params = [SamplingParams(max_tokens=200, temperature=temperature, seed=i, json_schema=s)
              for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(["Answer in JSON:"] * len(SCHEMAS), params)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason is not None and c.finish_reason.value == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_unconstrained_the_tiny_model_does_not_write_json(llm: LLM) -> None:
    """The control: without the constraint the same requests are not JSON (so the test above proves something)."""
    outs = llm.generate(["Answer in JSON:"] * 8, SamplingParams(max_tokens=30, temperature=1.0, seed=1))
    assert not any(_is_json(o.outputs[0].text) for o in outs)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_the_schema_is_compiled_once_for_many_requests(llm: LLM) -> None:
    schema = {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 3, "minItems": 1}
    before = llm.loop.grammars.compiled
    llm.generate(["x"] * 6, SamplingParams(max_tokens=20, temperature=1.0, json_schema=schema))
    llm.generate(["y"] * 2, SamplingParams(max_tokens=20, temperature=0.0, json_schema=schema))
    assert llm.loop.grammars.compiled == before + 1


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "langs": {"type": "array", "items": {"enum": ["en", "fr"]},
                                                     "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_with_the_openai_client(server: Server, stream: bool) -> None:
    client = server.client()
    kwargs: dict[str, Any] = dict(model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0, n=2, seed=4,
                                  response_format=_schema_format(PERSON))
    if stream:
        texts = ["", ""]
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
    else:
        r = client.chat.completions.create(**kwargs)
        assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
        texts = [c.message.content or "" for c in r.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_completions_response_format(server: Server) -> None:
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=150, temperature=0.0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    c = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=100, temperature=1.0,
                                  extra_body={"response_format": _schema_format(PERSON)})
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)


def test_llmc_regex_and_grammar_extensions(server: Server) -> None:
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=1.0,
                                       extra_body={"response_format": {"type": "regex",
                                                                       "regex": r"[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].message.content or "")
    lark = 'start: "(" item (", " item)* ")"\nitem: /[a-d]/\n'
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0.0,
                                       extra_body={"response_format": {"type": "grammar", "grammar": lark}})
    assert re.fullmatch(r"\([a-d](, [a-d])*\)", r.choices[0].message.content or ""), r.choices[0].message.content


def test_logit_bias_stop_token_ids_and_logprobs_on_chat(server: Server) -> None:
    client = server.client()
    token = server.llm.tokenizer.encode("e", add_special_tokens=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=1.0,
                                       logit_bias={str(token): 100}, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.message.content == server.llm.tokenizer.decode([token] * 5)
    assert choice.logprobs is not None and len(choice.logprobs.content) == 5
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=1.0,
                                       logit_bias={str(token): 100}, extra_body={"stop_token_ids": [token]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    assert r.usage.completion_tokens == 1


@pytest.mark.parametrize(("body", "words"), [
    ({"response_format": _schema_format({"type": "strin"})}, "JSON schema does not compile: Invalid type"),
    ({"response_format": _schema_format({"type": "string", "format": "zipcode"})}, "Unknown format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema must be"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be one of"),
    ({"response_format": {"type": "regex", "regex": "(unclosed"}}, "regular expression does not compile"),
    ({"response_format": {"type": "grammar", "grammar": "start: nowhere"}}, "grammar does not compile"),
    ({"logit_bias": {"abc": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"1": 500}}, "must be in [-100, 100]"),
    ({"logit_bias": {"99999": 1}}, "vocab size"),
])
def test_bad_constraints_are_400s_naming_the_problem(server: Server, body: dict[str, Any], words: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] in ("response_format", "logit_bias")
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=MODEL, messages=CHAT, **body)  # type: ignore[arg-type]


def test_a_bad_schema_beside_good_requests_hurts_none_of_them(server: Server) -> None:
    import concurrent.futures

    def good(i: int) -> str:
        r = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=120, temperature=1.0,
                                                    seed=i, response_format=_schema_format(PERSON))
        return r.choices[0].message.content or ""

    def bad() -> int:
        return httpx.post(server.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": CHAT,
                                "response_format": _schema_format({"type": "integer", "minimum": "x"})}).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(good, i) for i in range(3)]
        assert pool.submit(bad).result() == 400
        for f in goods:
            jsonschema.validate(json.loads(f.result()), PERSON)


def test_a_constraint_that_fails_while_decoding_is_a_400_naming_it(server: Server,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A constraint that compiles and then outgrows llguidance's limits a few tokens in (as `a{1000000}` does at
    its first; those are refused before they run) is the request's fault: 400 with `param`, an error event in a
    stream, never the engine's 500; the request beside it is untouched."""
    from llmc.runtime.structured import GrammarState

    compute = GrammarState._compute

    def failing_third(self: GrammarState) -> None:
        compute(self)
        self.masks = getattr(self, "masks", 0) + 1
        if self.masks >= 3 and self._constraint.text == "[0-9]{40}":
            self._error = "lexer error: too many expressions constructed"

    monkeypatch.setattr(GrammarState, "_compute", failing_third)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 50, "response_format": {"type": "regex", "regex": "[0-9]{40}"}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "failed while decoding: lexer error" in err["message"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert s.status_code == 200 and events[-1]["error"]["param"] == "response_format"
    ok = httpx.post(server.url + "/v1/chat/completions",
                    json={**body, "response_format": {"type": "regex", "regex": "[0-9]{4}"}})
    assert ok.status_code == 200 and re.fullmatch("[0-9]{4}", ok.json()["choices"][0]["message"]["content"])
