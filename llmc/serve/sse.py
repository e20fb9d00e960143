"""Server-sent events as the OpenAI streaming API sends them: one `data: {json}` event per chunk, `data: [DONE]` last."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import BaseModel

from llmc.serve.errors import ApiError, error_body


def sse(obj: BaseModel | dict[str, object]) -> str:
    body = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_error(err: ApiError) -> AsyncIterator[str]:
    """The error event a stream ends with when its request fails after the 200 went out (as vLLM does)."""
    yield sse(error_body(err.status, err.message, err.param, err.code))
    yield SSE_DONE
