"""tools / tool_choice on /v1/chat/completions with the real `openai` client, and the tool call parsers."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from llmc.runtime.config import RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.runtime.tool_calls import Function, ToolFormat, ToolStreamParser, parse_tool_calls, tool_grammar
from llmc.serve.app import ServeConfig
from llmc.serve.tools import template_message

from .conftest import MODEL, Server

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(serve_engine_dir: Path) -> Iterator[Server]:
    runtime = RuntimeConfig(max_running=4, threads=1, chat_template=str(TEMPLATE))
    s = Server(LLM(serve_engine_dir, runtime), ServeConfig(model_name=MODEL, runtime=runtime))
    yield s
    s.stop()


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_choices_always_give_a_call_that_parses(tool_server: Server,
                                                                   temperature: float) -> None:
    client = tool_server.client()
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                           max_tokens=140, temperature=temperature, seed=seed,
                                           parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls"
        _check_calls(r.choices[0].message.tool_calls or [], {"get_weather", "add"})
    # parallel: one call or more; the random model may chain calls until max_tokens (a real one ends them), and
    # then the complete ones are still returned
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                       max_tokens=140, temperature=temperature, seed=9)
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    _check_calls(r.choices[0].message.tool_calls or [], {"get_weather", "add"})
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=120,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=temperature, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and r.choices[0].message.content is None
    _check_calls(calls, {"get_weather"})


def test_streamed_tool_calls_arrive_as_openai_deltas(tool_server: Server) -> None:
    client = tool_server.client()
    kwargs: dict[str, Any] = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=120,
                                  temperature=1.0, seed=5)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            if d.id:
                assert d.type == "function" and d.function is not None and d.function.name
                entry["id"], entry["name"] = d.id, d.function.name
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls" and sorted(calls) == list(range(len(whole)))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_a_tool_result_turn_is_rendered_by_the_template(tool_server: Server) -> None:
    client = tool_server.client()
    first = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=120, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    call = (first.choices[0].message.tool_calls or [])[0]
    turn = [*CHAT, {"role": "assistant", "content": None,
                    "tool_calls": [{"id": call.id, "type": "function",
                                    "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    prompt = tool_server.llm.tokenizer.apply_chat_template([template_message(m) for m in turn], tools=TOOLS)
    assert "<tool_response>sunny</tool_response>" in prompt and call.function.arguments in prompt
    r = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", max_tokens=8,
                                       temperature=0)  # type: ignore[arg-type]
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("arguments", ["[" * 5000, '{"a": 1' + "0" * 5000 + "}"])
def test_tool_call_arguments_python_cannot_read_stay_a_string(tool_server: Server, arguments: str) -> None:
    """Nested past the recursion limit, or an integer over 4300 digits: rendered as sent, never a 500."""
    turn: list[dict[str, Any]] = [*CHAT, {"role": "assistant", "content": None,
                                          "tool_calls": [{"id": "call_1", "type": "function",
                                                          "function": {"name": "add", "arguments": arguments}}]}]
    assert template_message(turn[1])["tool_calls"][0]["function"]["arguments"] == arguments
    r = httpx.post(tool_server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": turn, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 400 and "prompt has" in r.json()["error"]["message"]  # long, not broken


def test_auto_parses_what_the_model_writes(tool_server: Server) -> None:
    """auto leaves the model free; its answer is content unless it wrote a call (the random model rarely does)."""
    r = tool_server.client().chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="auto",
                                                     max_tokens=10, temperature=1.0, seed=1)
    choice = r.choices[0]
    assert (choice.message.tool_calls is None) == (choice.finish_reason != "tool_calls")


@pytest.mark.parametrize(("body", "words"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name is required"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "must be 1-64 letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "does not compile"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "two tools are named"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tools_are_400s_naming_the_problem(tool_server: Server, body: dict[str, Any], words: str) -> None:
    r = httpx.post(tool_server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **body})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_a_template_that_ignores_tools_is_refused(server: Server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["code"] == "template_without_tools"


# -- the parsers, with no server --------------------------------------------------------------------------
HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def test_hermes_calls_parse_whole_and_streamed_in_any_pieces() -> None:
    content, calls = parse_tool_calls(ToolFormat.HERMES, HERMES_TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]
    rng = random.Random(0)
    for _ in range(20):
        parser, events, i = ToolStreamParser(ToolFormat.HERMES), [], 0
        while i < len(HERMES_TEXT):
            n = rng.randint(1, 7)
            events += parser.feed(HERMES_TEXT[i:i + n])
            i += n
        events += parser.finish()
        assert "".join(e for e in events if isinstance(e, str)) == content
        assert [(e.name, e.arguments) for e in events if not isinstance(e, str)] == \
            [(c.name, c.arguments) for c in calls]


def test_broken_calls_stay_content_and_llama3_json_parses() -> None:
    text = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(ToolFormat.HERMES, text) == (text, [])
    assert parse_tool_calls(ToolFormat.HERMES, "plain <tool_ text") == ("plain <tool_ text", [])
    content, calls = parse_tool_calls(ToolFormat.LLAMA3, '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                                         '{"name": "get_weather", "parameters": {"city": "x"}}')
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    assert parse_tool_calls(ToolFormat.LLAMA3, "The answer is 3.") == ("The answer is 3.", [])
    for unreadable in ("[" * 5000, '{"name": "add", "arguments": {"a": 1' + "0" * 5000 + "}}",
                       '{"name": "add", "arguments": "' + "[" * 5000 + '"}'):  # JSON Python's reader refuses
        text = f"<tool_call>\n{unreadable}\n</tool_call>"
        assert parse_tool_calls(ToolFormat.HERMES, text) == (text, [])


def test_the_llama3_format_by_flag(start_server: Any) -> None:
    runtime = RuntimeConfig(max_running=2, threads=1, chat_template=str(TEMPLATE))
    server = start_server(ServeConfig(model_name=MODEL, runtime=runtime, tool_call_parser=ToolFormat.LLAMA3))
    for stream in (False, True):
        r = server.client().chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                                    max_tokens=120, temperature=1.0, seed=2, stream=stream)
        if stream:
            names = [d.function.name for chunk in r for d in (chunk.choices[0].delta.tool_calls or [])
                     if chunk.choices and d.function and d.function.name]
            assert names and set(names) <= {"get_weather", "add"}
        else:
            _check_calls(r.choices[0].message.tool_calls or [], {"get_weather", "add"})


def test_forced_call_grammars_are_lark_with_the_tool_schemas() -> None:
    for fmt, key in ((ToolFormat.HERMES, '"arguments"'), (ToolFormat.LLAMA3, '"parameters"')):
        single = tool_grammar(fmt, [Function("add", ADD)], parallel=False)
        assert single.startswith("start: %json") if fmt is ToolFormat.LLAMA3 else "<tool_call>" in single
        assert key in single and '"const": "add"' in single and "call" not in single.split("\n")[0][:7]
        assert "call (" in tool_grammar(fmt, [Function("add", ADD)], parallel=True)
