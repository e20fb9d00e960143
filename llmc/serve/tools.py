"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request: checked, handed to the chat template, and
turned into the parser (and, for "required" or a named function, the grammar) that the answer goes through."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.tool_calls import Function, ToolFormat, detect_format, tool_grammar
from llmc.serve.errors import ApiError
from llmc.serve.protocol import ChatCompletionRequest

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolSetup:
    """What a request's tools change: the template's `tools`, the output parser's format, and the grammar that
    forces a call (None: the model chooses)."""

    tools: list[dict[str, Any]]  # as the chat template receives them
    fmt: ToolFormat
    parse: bool  # False for tool_choice "none": the answer is content only
    grammar: str | None


def tool_setup(req: ChatCompletionRequest, tokenizer: Tokenizer, fmt: ToolFormat | None) -> ToolSetup | None:
    """The request's tools, checked (400 naming the tool and the field at fault); None when it has none."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise ApiError(400, f"tool_choice {req.tool_choice!r} needs tools", param="tool_choice")
        return None
    if len(req.tools) > MAX_TOOLS:
        raise ApiError(400, f"too many tools: {len(req.tools)} > {MAX_TOOLS}", param="tools")
    functions = [_function(i, t) for i, t in enumerate(req.tools)]
    names = [f.name for f in functions]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ApiError(400, f"tools: two tools are named {dup!r}", param="tools")
    choice = _choice(req.tool_choice, names)
    fmt = fmt or detect_format(tokenizer.chat_template)
    forced = functions if choice == "required" else [f for f in functions if f.name == choice]
    grammar = None
    if choice not in ("auto", "none"):
        grammar = tool_grammar(fmt, forced, parallel=choice == "required" and req.parallel_tool_calls)
    tools = [{"type": "function", "function": t["function"]} for t in req.tools]
    return ToolSetup(tools, fmt, choice != "none", grammar)


def _function(i: int, tool: dict[str, Any]) -> Function:
    where = f"tools[{i}]"
    if tool.get("type", "function") != "function":
        raise ApiError(400, f"{where}.type must be 'function', got {tool.get('type')!r}", param="tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ApiError(400, f"{where}.function is required (an object with a 'name')", param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where}.function.name is required (a non-empty string)", param="tools")
    if not _NAME.match(name):
        raise ApiError(400, f"{where}.function.name {name!r} must be 1-64 letters, digits, '_', '.' or '-'",
                       param="tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema (an object), got "
                            f"{type(params).__name__}", param="tools")
    return Function(name, params)


def _choice(choice: str | dict[str, Any] | None, names: list[str]) -> str:
    """"auto", "none", "required", or the name of the function the request forces."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ApiError(400, f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}",
                           param="tool_choice")
        return choice
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, 'tool_choice must be {"type": "function", "function": {"name": ...}} when an object',
                       param="tool_choice")
    if name not in names:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                       param="tool_choice")
    return name


def template_message(d: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: an assistant's tool call arguments as objects (the templates of Llama
    and others write them with `tojson`), not the JSON strings OpenAI clients send."""
    calls = d.get("tool_calls")
    if not isinstance(calls, list):
        return d
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn = {**fn, "arguments": json.loads(fn["arguments"])}
            except (ValueError, RecursionError):  # not JSON, or JSON Python cannot read: it stays a string
                pass
            call = {**call, "function": fn}
        out.append(call)
    return {**d, "tool_calls": out}


def check_renders_tools(tokenizer: Tokenizer, messages: list[dict[str, Any]], prompt: str,
                        setup: ToolSetup) -> None:
    """A template that ignores `tools` would hide them from the model: refuse rather than answer without them."""
    if setup.parse and tokenizer.apply_chat_template(messages, add_generation_prompt=True) == prompt:
        raise ApiError(400, f"the chat template ({tokenizer.chat_template_source}) does not render tools: start the "
                            "server with --chat-template FILE (a template that renders `tools`, as Qwen's or "
                            "Hermes' do)", param="tools", code="template_without_tools")
