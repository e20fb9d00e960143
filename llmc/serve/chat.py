"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from llmc.runtime.request import FinishReason, TokenLogprob
from llmc.runtime.tool_calls import ToolCall, ToolFormat, ToolStreamParser, parse_tool_calls
from llmc.serve.context import Served
from llmc.serve.errors import ApiError, request_id
from llmc.serve.formats import constraint_fields
from llmc.serve.generation import ChoiceResult, Generation, SSEResponse, failure
from llmc.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    new_id,
)
from llmc.serve.sse import SSE_DONE, sse, sse_error
from llmc.serve.tools import ToolSetup, check_renders_tools, template_message, tool_setup


def _deltas(parser: ToolStreamParser | None, text: str,
            finish: FinishReason | None) -> tuple[list[Delta], str | None]:
    """A streamed update as deltas (content, and each finished tool call as OpenAI streams it: its id and name,
    then its arguments) and the finish reason to send ("tool_calls" once a call was made)."""
    reason = finish.value if finish is not None else None
    if parser is None:
        return ([Delta(content=text)] if text else []), reason
    events = parser.feed(text) + (parser.finish() if finish is not None else [])
    deltas = []
    k = parser.calls - sum(1 for e in events if isinstance(e, ToolCall))  # the index of this update's first call
    for e in events:
        if isinstance(e, str):
            deltas.append(Delta(content=e))
            continue
        deltas.append(Delta(tool_calls=[ToolCallDelta(index=k, id=e.id, type="function",
                                                      function=FunctionCallDelta(name=e.name, arguments=""))]))
        deltas.append(Delta(tool_calls=[ToolCallDelta(index=k, function=FunctionCallDelta(arguments=e.arguments))]))
        k += 1
    if reason == "stop" and parser.calls:
        reason = "tool_calls"
    return deltas, reason


def no_template_message(model: str) -> str:
    return (f"model {model!r} has no chat template: start the server with --chat-template FILE (a Jinja "
            "template), or send raw prompts to /v1/completions")


def _check(served: Served, req: ChatCompletionRequest) -> int | None:
    """Request-level checks; returns how many top logprobs to compute (None: no logprobs)."""
    served.check(req)
    if served.tokenizer.chat_template is None:
        raise ApiError(400, no_template_message(served.model_name), param="messages", code="no_chat_template")
    if not req.messages:
        raise ApiError(400, "messages must not be empty: at least 1 message is needed", param="messages")
    served.check_logprobs(req.top_logprobs, "top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _prompt_ids(served: Served, req: ChatCompletionRequest, tools: ToolSetup | None,
                constraint: dict[str, Any]) -> list[int]:
    """The rendered and tokenized conversation, its constraint compiled (run in a worker thread: long messages
    take seconds, a large schema a while)."""
    # (the tokenizer reads each message's content as templates take it: llmc.runtime.tokenizer.chat_message)
    messages = [template_message(m.model_dump(exclude_none=True)) for m in req.messages]
    text = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tools=tools.tools if tools else None)
    if tools is not None:
        check_renders_tools(served.tokenizer, messages, text, tools)
    served.compile_constraint(constraint)
    return served.encode(text, req, add_special_tokens=False)


def _constraint(req: ChatCompletionRequest, tools: ToolSetup | None) -> dict[str, Any]:
    """The SamplingParams constraint fields: response_format's, or the grammar a forced tool call needs."""
    fields = constraint_fields(req.response_format)
    if tools is not None and tools.grammar is not None:
        if fields:
            raise ApiError(400, "response_format cannot be combined with a tool_choice that forces a call",
                           param="response_format")
        return {"grammar": tools.grammar, "constraint_param": "tool_choice"}
    return fields


async def create_chat_completion(served: Served, req: ChatCompletionRequest, raw: Request) -> Response:
    top = _check(served, req)
    tools = tool_setup(req, served.tokenizer, served.tool_format)
    constraint = _constraint(req, tools)
    ids = await anyio.to_thread.run_sync(_prompt_ids, served, req, tools, constraint)
    max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None),
                      served.default_max_tokens([ids]))
    gen = served.start([ids], req.sampling_params(max_tokens, top, **constraint))
    rid = new_id("chatcmpl")
    fmt = tools.fmt if tools is not None and tools.parse else None
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_stream(served, gen, rid, usage, top is not None, fmt), on_close=gen.close,
                           request_id=request_id(raw))
    try:
        results = await gen.collect(raw.receive)
    finally:
        gen.close()
    choices = [_choice(served, r, top is not None, fmt) for r in results]
    body = ChatCompletion(id=rid, model=served.model_name, choices=choices, usage=served.usage(gen))
    return JSONResponse(body.model_dump())


def _choice(served: Served, r: ChoiceResult, want_logprobs: bool, fmt: ToolFormat | None) -> ChatChoice:
    reason = r.finish_reason.value if r.finish_reason else None
    content: str | None = r.text
    calls = None
    if fmt is not None:
        content, parsed = parse_tool_calls(fmt, r.text)
        if parsed:
            calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed]
            reason = "tool_calls" if reason == "stop" else reason
    return ChatChoice(index=r.index, message=AssistantMessage(content=content, tool_calls=calls),
                      logprobs=_logprobs(served, r.logprobs) if want_logprobs else None, finish_reason=reason)


def _logprobs(served: Served, items: list[TokenLogprob]) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = served.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for lp in items:
        e = entry(lp.token_id, lp.logprob)
        tops = [entry(t, v) for t, v in lp.top.items()]
        content.append(ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes, top_logprobs=tops))
    return ChatLogprobs(content=content)


async def _stream(served: Served, gen: Generation, rid: str, include_usage: bool,
                  want_logprobs: bool, fmt: ToolFormat | None) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice]) -> str:
        return sse(ChatCompletionChunk(id=rid, model=served.model_name, choices=choices))

    parsers = [ToolStreamParser(fmt) if fmt is not None else None for _ in range(gen.num_choices)]
    for i in range(gen.num_choices):
        yield chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
    async for i, u in gen.updates():
        if u.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            async for line in sse_error(failure(u.finish_reason, u.error)):
                yield line
            return
        lps = _logprobs(served, u.logprobs) if want_logprobs and u.logprobs else None
        deltas, reason = _deltas(parsers[i], u.text, u.finish_reason)
        for j, delta in enumerate(deltas or [Delta()]):
            last = j == max(len(deltas), 1) - 1
            if delta != Delta() or (last and (reason is not None or lps is not None)):
                yield chunk([ChatChunkChoice(index=i, delta=delta, logprobs=lps if last else None,
                                             finish_reason=reason if last else None)])
    if include_usage:
        yield sse(ChatCompletionChunk(id=rid, model=served.model_name, choices=[], usage=served.usage(gen)))
    yield SSE_DONE
