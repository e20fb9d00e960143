"""SamplingParams validation: each bad field is an InputError naming the field, value and rule."""

from __future__ import annotations

import math

import pytest

from llmc.errors import InputError
from llmc.runtime.request import CompletionOutput, FinishReason, RequestOutput, SamplingParams


def test_defaults_are_valid() -> None:
    p = SamplingParams()
    p.validate(vocab_size=49152)
    assert p.max_tokens == 256 and p.temperature == 1.0 and p.stop == [] and p.n == 1
    assert not p.greedy and not p.has_penalties


def test_mutable_defaults_not_shared() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be >= 0 and finite, got -1.0"),
        ({"temperature": math.nan}, "temperature must be >= 0 and finite, got nan"),
        ({"temperature": math.inf}, "temperature must be >= 0 and finite, got inf"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": math.nan}, "top_p must be in (0, 1], got nan"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"top_k": -2}, "top_k must be -1, 0 (off) or >= 1, got -2"),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5"),
        ({"frequency_penalty": math.inf}, "frequency_penalty must be in [-2, 2], got inf"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in [0.01, 100]"),
        ({"repetition_penalty": math.nan}, "repetition_penalty must be in [0.01, 100]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"stop": [f"s{i}" for i in range(20)]}, "too many stop strings: 20 > 16"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens must be <= max_tokens"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"stop_token_ids": [-3]}, "stop_token_ids must be non-negative integers, got -3"),
        ({"max_tokens": True}, "max_tokens must be >= 1"),
    ],
)
def test_invalid_fields(kwargs: dict, message: str) -> None:
    with pytest.raises(InputError) as exc:
        SamplingParams(**kwargs).validate(vocab_size=49152)
    text = str(exc.value)
    assert message in text
    assert "\n" not in text


def test_stop_token_id_beyond_vocab() -> None:
    p = SamplingParams(stop_token_ids=[2, 99999])
    with pytest.raises(InputError, match=r"stop_token_ids contains 99999 >= vocab size 49152"):
        p.validate(vocab_size=49152)
    p.validate()  # without a vocab size the bound is not known


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_k": -1},
        {"top_k": 50, "top_p": 0.9, "min_p": 0.05},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"logprobs": 0},
        {"logprobs": 20},
        {"stop": [f"s{i}" for i in range(16)]},
        {"min_tokens": 5, "max_tokens": 5},
        {"seed": 0},
    ],
)
def test_valid_edges(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate(vocab_size=100)


def test_finish_reason_is_openai_string() -> None:
    assert FinishReason.STOP == "stop" and FinishReason.LENGTH.value == "length"
    assert FinishReason("abort") is FinishReason.ABORT


def test_outputs_construct() -> None:
    c = CompletionOutput(text="hi", token_ids=[1, 2], finish_reason=FinishReason.LENGTH)
    r = RequestOutput(request_id="r1", prompt="p", prompt_token_ids=[5], outputs=[c], finished=True)
    assert r.outputs[0].logprobs is None and r.finished
