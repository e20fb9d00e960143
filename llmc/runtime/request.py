"""Per-request sampling parameters and the outputs a request produces."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from llmc.errors import InputError
from llmc.runtime.structured import Constraint

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias in [-100, 100]
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing float32 logits by it would overflow.
GREEDY_BELOW_TEMPERATURE = 1e-5
# repetition_penalty divides or multiplies float32 logits: outside this range they overflow or vanish.
REPETITION_PENALTY_RANGE = (1e-2, 1e2)


class FinishReason(str, Enum):
    """Why a sequence ended; the values are the OpenAI `finish_reason` strings (plus abort/error)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


# A logit_bias key as clients write a token id (int() would also read " 5", "+5", "5_0" as 50, or "\u0665"); a
# sign is left to SamplingParams.validate, which names the rule
_TOKEN_ID = re.compile(r"-?[0-9]{1,18}")


def logit_bias_of_json(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys: strings) with integer keys; the values are checked by
    SamplingParams.validate. A key that is not plainly an integer ("5_0", " 5", "+5") is refused, not read."""
    if bias is not None and not isinstance(bias, dict):
        raise InputError(f"logit_bias must map token ids to biases, got {type(bias).__name__}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise InputError(f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    `temperature` below `GREEDY_BELOW_TEMPERATURE` (0 included) means greedy; `top_k` 0 or -1 and `top_p == 1` and
    `min_p == 0` are "off".
    Call `validate()` at the boundary (server or CLI); the sampler assumes valid values.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # constrained decoding (at most one): a JSON schema (a dict, or its JSON text), a regular expression, or a
    # grammar (Lark, or llama.cpp's GBNF); the output matches it whatever the model prefers
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    constraint_param: str | None = None  # the request field a constraint came from, for error messages

    @property
    def constraint(self) -> Constraint | None:
        return Constraint.of(self.json_schema, self.regex, self.grammar, self.constraint_param)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None, logits_size: int | None = None) -> None:
        """Raise `InputError` (one line: field, value, rule) on the first invalid field. vocab_size: the ids the
        model takes (a stop id is any of them); logits_size: those it can produce (a biased id must be one), the same
        unless its head is pruned (ModelSpec.output_vocab_size)."""
        self._validate_counts()
        self._validate_sampling()
        self._validate_penalties()
        self._validate_stops(vocab_size)
        self._validate_logit_bias(logits_size or vocab_size, vocab_size)
        self._validate_constraint()

    def _validate_counts(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_int(self.n) or self.n < 1:
            raise InputError(f"n must be >= 1, got {self.n!r}", "n")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InputError(f"min_tokens must be >= 0, got {self.min_tokens!r}", "min_tokens")
        if self.min_tokens > self.max_tokens:
            raise InputError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={self.max_tokens}",
                "min_tokens")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InputError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}", "logprobs")
        if self.seed is not None and not _is_int(self.seed):
            raise InputError(f"seed must be an integer or null, got {self.seed!r}", "seed")
        if not isinstance(self.ignore_eos, bool):  # (a truthy "no" would ignore the EOS)
            raise InputError(f"ignore_eos must be True or False, got {self.ignore_eos!r}", "ignore_eos")

    def _validate_sampling(self) -> None:
        t = self.temperature
        if not _is_finite(t) or t < 0:
            raise InputError(f"temperature must be >= 0 and finite, got {t!r}", "temperature")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InputError(f"top_k must be -1, 0 (off) or >= 1, got {self.top_k!r}", "top_k")
        p = self.top_p
        if not _is_finite(p) or not 0 < p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {p!r}", "top_p")
        m = self.min_p
        if not _is_finite(m) or not 0 <= m <= 1:
            raise InputError(f"min_p must be in [0, 1], got {m!r}", "min_p")

    def _validate_penalties(self) -> None:
        r, (low, high) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        if not _is_finite(r) or not low <= r <= high:
            raise InputError(f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off), got {r!r}",
                             "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_finite(v) or not -2 <= v <= 2:
                raise InputError(f"{name} must be in [-2, 2], got {v!r}", name)

    def _validate_stops(self, vocab_size: int | None) -> None:
        for name in ("stop", "stop_token_ids"):  # (a str would stop at each of its characters)
            if not isinstance(getattr(self, name), list | tuple):
                raise InputError(f"{name} must be a list, got {getattr(self, name)!r:.60}", name)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InputError(f"too many stop_token_ids: {len(self.stop_token_ids)} > {MAX_STOP_TOKEN_IDS}",
                             "stop_token_ids")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InputError(f"too many stop strings: {len(self.stop)} > {MAX_STOP_STRINGS}", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InputError(f"stop strings must be non-empty strings, got {s!r}", "stop")
        for tid in self.stop_token_ids:
            if not _is_int(tid) or tid < 0:
                raise InputError(f"stop_token_ids must be non-negative integers, got {tid!r}", "stop_token_ids")
            if vocab_size is not None and tid >= vocab_size:
                raise InputError(f"stop_token_ids contains {tid} >= vocab size {vocab_size}", "stop_token_ids")


    def _validate_logit_bias(self, logits_size: int | None, vocab_size: int | None) -> None:
        if not isinstance(self.logit_bias, dict):
            raise InputError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}",
                             "logit_bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InputError(f"too many logit_bias entries: {len(self.logit_bias)} > {MAX_LOGIT_BIAS}", "logit_bias")
        for tid, bias in self.logit_bias.items():
            if not _is_int(tid) or tid < 0:
                raise InputError(f"logit_bias keys must be token ids (integers >= 0), got {tid!r}", "logit_bias")
            if logits_size is not None and tid >= logits_size:
                past = ("" if logits_size == vocab_size or tid >= (vocab_size or 0)
                        else f" (the model's head produces ids below {logits_size} only)")
                raise InputError(f"logit_bias token id {tid} >= vocab size {logits_size}{past}", "logit_bias")
            if not _is_finite(bias) or abs(bias) > LOGIT_BIAS_RANGE:
                raise InputError(f"logit_bias[{tid}] must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                                 f"got {bias!r}", "logit_bias")

    def _validate_constraint(self) -> None:
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise InputError(f"give at most one of json_schema, regex and grammar, got {' and '.join(given)}",
                             self.constraint_param or given[1])
        if self.json_schema is not None and not isinstance(self.json_schema, dict | str):
            raise InputError(f"json_schema must be a dict or a JSON string, got {type(self.json_schema).__name__}",
                             self.constraint_param or "json_schema")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InputError(f"{name} must be a non-empty string, got {v!r}", self.constraint_param or name)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_finite(v: object) -> bool:
    """A number a float carries (an int too large for a float is not)."""
    if not _is_num(v):
        return False
    try:
        return math.isfinite(v)  # type: ignore[arg-type]
    except OverflowError:
        return False


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the `top` most likely alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request, as produced so far."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    index: int = 0
    error: Exception | None = None  # with FinishReason.ERROR: the cause, when known (an InputError: the request's)


@dataclass
class RequestOutput:
    """A request's state as reported to the caller (a streaming delta or the final result)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
