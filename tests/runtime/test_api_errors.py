"""The Python API refuses bad arguments with one `InputError` naming the value and the rule (not a TypeError from
inside llmc, not a silent nonsense run)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llmc.errors import InputError
from llmc.runtime.async_engine import AsyncEngineConfig
from llmc.runtime.llm import LLM, LLMConfig
from llmc.runtime.request import SamplingParams


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"stop": "abc"}, "stop", "stop must be a list, got 'abc'"),  # was three one-character stops
    ({"stop": None}, "stop", "stop must be a list, got None"),
    ({"stop_token_ids": 5}, "stop_token_ids", "stop_token_ids must be a list, got 5"),
    ({"stop_token_ids": None}, "stop_token_ids", "stop_token_ids must be a list, got None"),
    ({"ignore_eos": "no"}, "ignore_eos", "ignore_eos must be True or False, got 'no'"),  # was truthy: ignored
])
def test_sampling_params_of_the_wrong_type(fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InputError) as e:
        SamplingParams(**fields).validate(100)
    assert (str(e.value), e.value.param) == (message, param)


@pytest.mark.parametrize(("fields", "message"), [
    ({"threads": "2"}, "--threads must be an integer, got '2'"),
    ({"max_running": 2.5}, "--max-running must be an integer, got 2.5"),
    ({"kv_budget_mb": float("nan")}, "--kv-budget-mb must be an integer, got nan"),
    ({"max_step_tokens": None}, "--max-step-tokens must be an integer, got None"),
    ({"min_chunk": True}, "--min-chunk must be an integer, got True"),
    ({"kv_block_size": 64.0}, "--kv-block-size must be an integer, got 64.0"),
    ({"prefix_caching": "no"}, "prefix_caching must be True or False, got 'no'"),
    ({"kv_prefault": 1}, "kv_prefault must be True or False, got 1"),
    ({"chat_template": 5}, "--chat-template must be a file path, got 5"),
])
def test_llm_config_of_the_wrong_type(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as e:
        LLMConfig(**fields)
    assert str(e.value) == message and e.value.param == next(iter(fields))


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_queue": -1}, "--max-queue must be an integer >= 0, got -1"),
    ({"max_queue": "8"}, "--max-queue must be an integer >= 0, got '8'"),
    ({"retry_after_s": float("nan")}, "retry_after_s must be a finite number >= 0, got nan"),
    ({"retry_after_s": -1.0}, "retry_after_s must be a finite number >= 0, got -1.0"),
])
def test_async_engine_config_out_of_range(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        AsyncEngineConfig(**fields)


@pytest.fixture(scope="module")
def llm(serve_engine_dir: Path) -> LLM:
    return LLM(serve_engine_dir, LLMConfig(threads=1, max_running=2))


SP = SamplingParams(max_tokens=2, temperature=0.0)
MSG = {"role": "user", "content": "hi"}
# (what is called, the param named, words of the message)
CALLS: list[tuple[str, Callable[[LLM], Any], str, str]] = [
    ("generate(None)", lambda m: m.generate(None, SP), "prompt", "got NoneType"),  # type: ignore[arg-type]
    ("generate(5)", lambda m: m.generate(5, SP), "prompt", "got int"),  # type: ignore[arg-type]
    ("generate(bytes)", lambda m: m.generate(b"hi", SP), "prompt", "got bytes"),  # type: ignore[arg-type]
    ("float ids", lambda m: m.generate([1.5, 2.0], SP), "prompt", "token ids must be integers, got 1.5"),  # type: ignore[arg-type, list-item]
    ("a str among ids", lambda m: m.generate([1, "a"], SP), "prompt", "must be integers, got 'a'"),  # type: ignore[arg-type, list-item]
    ("bool ids", lambda m: m.generate([True, False], SP), "prompt", "must be integers, got True"),  # type: ignore[arg-type]
    ("None ids", lambda m: m.generate([None], SP), "prompt", "must be integers, got None"),  # type: ignore[arg-type, list-item]
    ("encode(5)", lambda m: m.encode(5), "prompt", "a string or a list of token ids, got int"),  # type: ignore[arg-type]
    ("params dict", lambda m: m.generate("hi", {"max_tokens": 2}), "params", "got dict"),  # type: ignore[arg-type]
    ("params str", lambda m: m.generate("hi", "x"), "params", "got str"),  # type: ignore[arg-type]
    ("params list of dict", lambda m: m.generate(["hi"], [{"max_tokens": 2}]), "params",  # type: ignore[arg-type, list-item]
     "params must be a SamplingParams, got dict"),
    ("chat(dict)", lambda m: m.chat(MSG, SP), "messages", "got dict"),  # type: ignore[arg-type]
    ("chat(None)", lambda m: m.chat(None, SP), "messages", "got NoneType"),  # type: ignore[arg-type]
    ("chat([])", lambda m: m.chat([], SP), "messages", "messages must not be empty"),  # was [] (no outputs)
    ("chat(str)", lambda m: m.chat("hello", SP), "messages", "got str"),  # type: ignore[arg-type]
    ("chat([str])", lambda m: m.chat(["hi"], SP), "messages", "a conversation must be a list"),  # type: ignore[arg-type, list-item]
    ("stream(str)", lambda m: list(m.stream("hello", SP)), "prompt", "llm.encode(text)"),  # type: ignore[arg-type]
    ("stream params list", lambda m: list(m.stream([5], [SP])), "params", "got list"),  # type: ignore[arg-type]
    ("check_request ids", lambda m: m.loop.check_request([1, "a"], SP), "prompt", "got 'a'"),  # type: ignore[arg-type, list-item]
    ("LLM(None)", lambda m: LLM(None), "engine_dir", "engine_dir must be a folder path"),  # type: ignore[arg-type]
    ("LLM(config=dict)", lambda m: LLM(m.engine_dir, {"max_running": 2}), "config",  # type: ignore[arg-type]
     "config must be an LLMConfig, got dict"),
]


@pytest.mark.parametrize(("call", "param", "words"), [c[1:] for c in CALLS], ids=[c[0] for c in CALLS])
def test_bad_python_arguments_are_one_line_errors(llm: LLM, call: Callable[[LLM], Any], param: str,
                                                  words: str) -> None:
    with pytest.raises(InputError) as e:
        call(llm)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert e.value.param == param
    assert not llm.loop.has_work and not llm.loop.requests  # refused before anything was queued


def test_the_llm_still_runs_after_refusals(llm: LLM) -> None:
    (out,) = llm.generate([[5, 6, 7]], SP)
    assert len(out.outputs[0].token_ids) == 2
    (out,) = llm.chat([MSG], SP)
    assert out.outputs[0].token_ids
