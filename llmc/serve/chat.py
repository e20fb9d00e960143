"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from llmc.runtime.request import FinishReason, TokenLogprob
from llmc.serve.context import Served
from llmc.serve.errors import ApiError, request_id
from llmc.serve.generation import Generation, SSEResponse, failure
from llmc.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    Delta,
    TopLogprob,
    new_id,
)
from llmc.serve.sse import SSE_DONE, sse, sse_error


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
    if req.tools:
        raise ApiError(400, "tools are not supported by this server", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise ApiError(400, "response_format other than text is not supported", param="response_format")
    served.check_logprobs(req.top_logprobs, "top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _message_dict(i: int, m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: its text parts joined into one string. A part the model cannot
    read (an image, audio, a file) is refused, never dropped: the answer would ignore it."""
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        for j, part in enumerate(m.content):
            if part.type != "text":
                raise ApiError(400, f"messages.{i}.content.{j} is a content part of type {part.type!r}: this model "
                                    "reads text only (parts of type 'text')", param="messages")
            if part.text is None:
                raise ApiError(400, f"messages.{i}.content.{j} is a text part without 'text'", param="messages")
        d["content"] = "".join(p.text or "" for p in m.content)
    d.setdefault("content", "")
    return d


def _prompt_ids(served: Served, req: ChatCompletionRequest) -> list[int]:
    """The rendered and tokenized conversation (run in a worker thread: long messages take seconds)."""
    text = served.tokenizer.apply_chat_template([_message_dict(i, m) for i, m in enumerate(req.messages)],
                                                add_generation_prompt=True)
    return served.encode(text, req, add_special_tokens=False)


async def create_chat_completion(served: Served, req: ChatCompletionRequest, raw: Request) -> Response:
    top = _check(served, req)
    ids = await anyio.to_thread.run_sync(_prompt_ids, served, req)
    max_tokens = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None),
                      served.default_max_tokens([ids]))
    gen = served.start([ids], req.sampling_params(max_tokens, top))
    rid = new_id("chatcmpl")
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_stream(served, gen, rid, usage, top is not None), on_close=gen.close,
                           request_id=request_id(raw))
    try:
        results = await gen.collect(raw.receive)
    finally:
        gen.close()
    choices = [ChatChoice(index=r.index, message=AssistantMessage(content=r.text),
                          logprobs=_logprobs(served, r.logprobs) if top is not None else None,
                          finish_reason=r.finish_reason.value if r.finish_reason else None) for r in results]
    body = ChatCompletion(id=rid, model=served.model_name, choices=choices, usage=served.usage(gen))
    return JSONResponse(body.model_dump())


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
                  want_logprobs: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice]) -> str:
        return sse(ChatCompletionChunk(id=rid, model=served.model_name, choices=choices))

    for i in range(gen.num_choices):
        yield chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
    async for i, u in gen.updates():
        if u.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            async for line in sse_error(failure(u.finish_reason)):
                yield line
            return
        lps = _logprobs(served, u.logprobs) if want_logprobs and u.logprobs else None
        if u.text or u.finish_reason is not None or lps is not None:
            yield chunk([ChatChunkChoice(index=i, delta=Delta(content=u.text) if u.text else Delta(),
                                         logprobs=lps,
                                         finish_reason=u.finish_reason.value if u.finish_reason else None)])
    if include_usage:
        yield sse(ChatCompletionChunk(id=rid, model=served.model_name, choices=[], usage=served.usage(gen)))
    yield SSE_DONE
