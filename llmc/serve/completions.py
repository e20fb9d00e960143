"""POST /v1/completions (raw prompts: text, token ids, or a batch of either)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from llmc.runtime.request import FinishReason, TokenLogprob
from llmc.serve.context import Served
from llmc.serve.errors import ApiError, request_id
from llmc.serve.formats import constraint_fields
from llmc.serve.generation import Generation, SSEResponse, failure
from llmc.serve.protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, new_id
from llmc.serve.sse import SSE_DONE, sse, sse_error


def _prompts(served: Served, req: CompletionRequest, constraint: dict[str, Any]) -> list[list[int]]:
    """The request's prompts as token ids; an empty prompt is refused, never sent to the engine. The constraint
    (response_format) is compiled here too: both take a while."""
    served.compile_constraint(constraint)
    p = req.prompt
    items: list[str | list[int]]
    if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
        items = [p]  # type: ignore[list-item]  # one text, or one list of token ids
    else:
        items = list(p)  # type: ignore[arg-type]  # a batch of either
    if not items:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    out = []
    for x in items:
        if not x:
            raise ApiError(400, "prompt must not be empty: at least 1 token is needed", param="prompt")
        out.append(served.encode(x, req, add_special_tokens=True) if isinstance(x, str) else served.prompt_ids(x, req))
    return out


def _check(served: Served, req: CompletionRequest) -> None:
    served.check(req)
    served.check_logprobs(req.logprobs, "logprobs")
    if req.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")


async def create_completion(served: Served, req: CompletionRequest, raw: Request) -> Response:
    _check(served, req)
    constraint = constraint_fields(req.response_format)
    prompts = await anyio.to_thread.run_sync(_prompts, served, req, constraint)  # long texts tokenize for seconds
    max_tokens = req.max_tokens if req.max_tokens is not None else served.default_max_tokens(prompts)
    gen = served.start(prompts, req.sampling_params(max_tokens, req.logprobs, **constraint))
    rid = new_id("cmpl")
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return SSEResponse(_stream(served, gen, rid, usage, req.logprobs is not None), on_close=gen.close,
                           request_id=request_id(raw))
    try:
        results = await gen.collect(raw.receive)
    finally:
        gen.close()
    choices = [CompletionChoice(index=r.index, text=r.text,
                                logprobs=_logprobs(served, r.logprobs, 0) if req.logprobs is not None else None,
                                finish_reason=r.finish_reason.value if r.finish_reason else None) for r in results]
    body = Completion(id=rid, model=served.model_name, choices=choices, usage=served.usage(gen))
    return JSONResponse(body.model_dump())


def _logprobs(served: Served, items: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """OpenAI's legacy layout; `offset` is where the first token's text starts in the choice's text."""
    out = CompletionLogprobs()
    for lp in items:
        token = served.token_text(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({token: lp.logprob, **{served.token_text(t): v for t, v in lp.top.items()}})
        out.text_offset.append(offset)
        offset += len(token)
    return out


async def _stream(served: Served, gen: Generation, rid: str, include_usage: bool,
                  want_logprobs: bool) -> AsyncIterator[str]:
    offsets = [0] * gen.num_choices
    async for i, u in gen.updates():
        if u.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            async for line in sse_error(failure(u.finish_reason, u.error)):
                yield line
            return
        lps = _logprobs(served, u.logprobs, offsets[i]) if want_logprobs and u.logprobs else None
        offsets[i] += len(u.text)
        if u.text or u.finish_reason is not None or lps is not None:
            choice = CompletionChoice(index=i, text=u.text, logprobs=lps,
                                      finish_reason=u.finish_reason.value if u.finish_reason else None)
            yield sse(Completion(id=rid, model=served.model_name, choices=[choice]))
    if include_usage:
        yield sse(Completion(id=rid, model=served.model_name, choices=[], usage=served.usage(gen)))
    yield SSE_DONE
