"""Tool calls in a model's output: the two formats chat templates teach, their parsers (whole and streaming), and
the grammar that forces a call when the request requires one.

- hermes (Hermes, Qwen 2.5/3, many fine-tunes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call.
- llama3 (Llama 3.1+ JSON tool calling): the whole answer is `{"name": ..., "parameters": {...}}`, several calls
  separated by `;` (the `<|python_tag|>` special token before it is dropped by detokenizing).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from llmc.runtime.structured import JSON_OPTIONS

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


class ToolFormat(str, Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"


def detect_format(template: str | None) -> ToolFormat:
    """The format a chat template teaches: Llama 3's when it speaks of ipython / python_tag, else Hermes'."""
    if template and HERMES_OPEN not in template and ("<|python_tag|>" in template or "ipython" in template):
        return ToolFormat.LLAMA3
    return ToolFormat.HERMES


@dataclass(frozen=True)
class Function:
    """A tool the request offers: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def tool_grammar(fmt: ToolFormat, tools: Sequence[Function], parallel: bool) -> str:
    """A Lark grammar (llguidance) whose every sentence is a call of one of `tools` in `fmt` (one or more calls when
    `parallel`): what `tool_choice` "required" or a named function decodes under."""
    key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": t.name}, key: t.parameters},
                "required": ["name", key], "additionalProperties": False} for t in tools]
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": JSON_OPTIONS}
    call = f"%json {json.dumps(schema)}"
    if fmt is ToolFormat.HERMES:
        call = f"{json.dumps(HERMES_OPEN + chr(10))} {call} {json.dumps(chr(10) + HERMES_CLOSE)}"
    sep = '"; "' if fmt is ToolFormat.LLAMA3 else '"\\n"'
    return f"start: call ({sep} call)*\ncall: {call}\n" if parallel else f"start: {call}\n"


def _call_of(text: str, fmt: ToolFormat) -> ToolCall | None:
    """A call from its JSON text, or None when it is not one (nor JSON Python reads: nested past its recursion
    limit, or an integer over its 4,300 digits; the text then stays content, nothing is lost)."""
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {})) if fmt is ToolFormat.HERMES else \
            obj.get("parameters", obj.get("arguments", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    except (ValueError, RecursionError):  # json.JSONDecodeError is a ValueError
        return None


def parse_tool_calls(fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """The content (None when nothing but calls) and the calls of a whole answer. Text that looks like a call but
    does not parse stays content."""
    parser = ToolStreamParser(fmt)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None), [e for e in events if isinstance(e, ToolCall)]


class ToolStreamParser:
    """Splits streamed text into content and tool calls. `feed` and `finish` return events in order: content
    strings and `ToolCall`s. Text that may still begin a call is held back; whitespace between calls is dropped."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._buf = ""
        self._in_call = False
        self._mode: str | None = None  # llama3: "json" once the answer starts with "{", "text" otherwise
        self._space = ""  # whitespace held until content follows it
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        return self._llama3(final=False) if self.fmt is ToolFormat.LLAMA3 else self._hermes()

    def finish(self) -> list[str | ToolCall]:
        if self.fmt is ToolFormat.LLAMA3:
            return self._llama3(final=True)
        out: list[str | ToolCall] = []
        rest, self._buf = self._buf, ""
        if self._in_call:
            call = _call_of(rest.strip(), self.fmt)  # a model may end right after the JSON, without the tag
            out += [self._count(call)] if call is not None else self._content(HERMES_OPEN + rest)
        else:
            out += self._content(rest)
        self._space = ""
        return out

    def _hermes(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                i = self._buf.find(HERMES_OPEN)
                if i < 0:
                    keep = _partial_suffix(self._buf, HERMES_OPEN)
                    out += self._content(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                out += self._content(self._buf[:i])
                self._buf, self._in_call, self._space = self._buf[i + len(HERMES_OPEN):], True, ""
            else:
                j = self._buf.find(HERMES_CLOSE)
                if j < 0:
                    return out
                body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(HERMES_CLOSE):], False
                call = _call_of(body.strip(), self.fmt)
                out += [self._count(call)] if call is not None else self._content(HERMES_OPEN + body + HERMES_CLOSE)

    def _llama3(self, final: bool) -> list[str | ToolCall]:
        if self._mode is None:
            head = self._buf.lstrip()
            if not head and not final:
                return []
            self._mode = "json" if head.startswith("{") else "text"
        if self._mode == "text":
            text, self._buf = self._buf, ""
            return [text] if text else []
        if not final:
            return []
        text, self._buf = self._buf, ""
        calls = [_call_of(part.strip(), self.fmt) for part in _split_calls(text)]
        if calls and all(c is not None for c in calls):
            return [self._count(c) for c in calls if c is not None]
        return [text]

    def _content(self, text: str) -> list[str | ToolCall]:
        if not text:
            return []
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        out, self._space = self._space + body, text[len(body):]  # trailing whitespace waits for what follows
        return [out]

    def _count(self, call: ToolCall) -> ToolCall:
        self.calls += 1
        return call


def _split_calls(text: str) -> list[str]:
    """Llama 3's `;`-separated calls (a `;` inside a JSON string does not split)."""
    parts = re.split(r"(?<=\})\s*;\s*(?=\{)", text.strip())
    return [p for p in parts if p.strip()]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
