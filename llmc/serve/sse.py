"""Server-sent events as the OpenAI streaming API sends them: one `data: {json}` event per chunk, `data: [DONE]` last."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import BaseModel

from llmc.serve.errors import ApiError, error_body

# Characters a JSON encoder may leave raw in a string that line splitters other than SSE's own (Python's
# str.splitlines, httpx's iter_lines) break a line at: escaped, so a model's text never splits its event.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: BaseModel | dict[str, object]) -> str:
    body = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {body.translate(_LINE_BREAKS)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_error(err: ApiError) -> AsyncIterator[str]:
    """The error event a stream ends with when its request fails after the 200 went out (as vLLM does)."""
    yield sse(error_body(err.status, err.message, err.param, err.code))
    yield SSE_DONE
