"""OpenAI-compatible request and response bodies (the subset llmc serves, plus vLLM's common extras).

Requests are validated strictly (no "1" for 1, no true for 1); the value rules (ranges, limits) are
`SamplingParams.validate`'s, so the server and the Python API refuse the same things with the same words.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmc.runtime.request import SamplingParams, logit_bias_of_json


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# JSON nesting a body may have: deeper is refused before anything recurses through it (the JSON schema compiler
# refuses deeper schemas too; Python's recursion limit would fail the server, not the request)
MAX_DEPTH = 128


class BadBody(ValueError):
    """JSON the server does not read; `path` names where (its first element: the request field)."""

    def __init__(self, path: list[str], message: str) -> None:
        self.path = path
        super().__init__(message)


class NotText(BadBody):
    """A string in the body that is not Unicode text (a lone UTF-16 surrogate such as "\\ud800")."""

    def __init__(self, path: list[str], char: str) -> None:
        where = ".".join(path) or "body"
        super().__init__(path, f"{where} holds a lone UTF-16 surrogate (U+{ord(char):04X}), which is not text; "
                               "send valid Unicode")


class TooDeep(BadBody):
    def __init__(self, path: list[str]) -> None:
        where = ".".join(path[:4]) or "body"
        super().__init__(path, f"{where} nests JSON deeper than {MAX_DEPTH} levels, the limit")


def _check_text(value: Any, path: list[str]) -> None:
    """Raise `NotText` for the first string (key or value, at any depth) that cannot be encoded as UTF-8, `TooDeep`
    for an object or array nested deeper than `MAX_DEPTH`."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise NotText(path, value[e.start]) from None
    elif isinstance(value, dict | list) and len(path) >= MAX_DEPTH:
        raise TooDeep(path)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, path)
            _check_text(v, [*path, str(k)])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, [*path, str(i)])


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # {"type": "text" | "json_object" | "json_schema" | "regex" | "grammar", ...} (regex, grammar: llmc's own);
    # checked by llmc.serve.formats, which names the field at fault
    response_format: dict[str, Any] | None = None
    # extras (vLLM's names), sent by the openai client through `extra_body`
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        _check_text(data, [])
        return data

    def sampling_params(self, max_tokens: int, logprobs: int | None, **constraint: Any) -> SamplingParams:
        """The request's sampling parameters; `constraint`: SamplingParams' json_schema / regex / grammar fields."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(**constraint, logit_bias=logit_bias_of_json(self.logit_bias),
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, logprobs=logprobs, n=self.n)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for the legacy endpoint
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # checked by llmc.serve.tools (errors name the tool at fault)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


# -- responses ---------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """One piece of a streamed call: the first has its id, type and name, the next its arguments (as OpenAI)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None


class ChatCompletion(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Completion(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmc"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
