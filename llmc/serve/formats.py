"""`response_format` as SamplingParams' constraint fields (json_schema / regex / grammar).

OpenAI's types: `text`, `json_object` (any JSON object), `json_schema` (`{"json_schema": {"name", "schema",
"strict"}}`). llmc's own: `regex` (`{"type": "regex", "regex": "..."}`) and `grammar` (`{"type": "grammar",
"grammar": "..."}`, Lark or llama.cpp's GBNF). A schema is enforced whatever `strict` says: the output always
matches it.
"""

from __future__ import annotations

from typing import Any

from llmc.serve.errors import ApiError

TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_PARAM = "response_format"


def constraint_fields(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """The constraint a response_format asks for, as SamplingParams keyword arguments (empty: none)."""
    if response_format is None:
        return {}
    kind = response_format.get("type")
    if kind not in TYPES:
        raise ApiError(400, f"response_format.type must be one of {', '.join(TYPES)}, got {kind!r}", param=_PARAM)
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}, "constraint_param": _PARAM}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(400, "response_format.json_schema must be an object with a 'schema'", param=_PARAM)
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, f"response_format.json_schema.schema must be a JSON schema (an object), got "
                                f"{type(schema).__name__ if schema is not None else 'nothing'}", param=_PARAM)
        if "strict" in spec and not isinstance(spec["strict"], bool):
            raise ApiError(400, f"response_format.json_schema.strict must be a boolean, got {spec['strict']!r}",
                           param=_PARAM)
        return {"json_schema": schema, "constraint_param": _PARAM}
    text = response_format.get(kind)
    if not isinstance(text, str) or not text:
        raise ApiError(400, f"response_format.{kind} must be a non-empty string (with type {kind!r})", param=_PARAM)
    return {kind: text, "constraint_param": _PARAM}
