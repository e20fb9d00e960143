"""The SSE framing: a model's text, whatever characters it holds, stays inside its one `data:` line, for SSE's own
line rule and for the stricter splitters clients use (Python's str.splitlines, httpx's iter_lines)."""

from __future__ import annotations

import json

from llmc.serve.protocol import ChatCompletionChunk
from llmc.serve.sse import sse

# every character str.splitlines breaks at, with text around them
TEXT = "a\nb\rc\x0bd\x0ce\x1cf\x1dg\x1eh\x85i\u2028j\u2029k"


def test_an_event_is_one_line_and_its_json_round_trips() -> None:
    chunk = ChatCompletionChunk.model_validate({
        "id": "c", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": {"content": TEXT}, "finish_reason": None}]})
    event = sse(chunk)
    assert event.endswith("\n\n")
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:])["choices"][0]["delta"]["content"] == TEXT
    assert [line for line in sse({"text": TEXT}).splitlines() if line] == [f"data: {json.dumps({'text': TEXT})}"]
