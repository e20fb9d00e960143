"""JSON schemas the constrained-decoding tests run (each answer must parse and validate against its schema).

Bounded (string lengths, item counts, numeric ranges, closed objects) because the tiny test model is random: an
unbounded string or integer would run to max_tokens, which a real model ends; every feature class appears.
"""

from __future__ import annotations

from typing import Any

S = {"type": "string", "maxLength": 6}
INT = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS: list[dict[str, Any]] = [
    # scalars
    {"type": "boolean"},
    {"type": "null"},
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "integer", "minimum": 100, "maximum": 120},
    {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "minimum": -10.5, "maximum": 10.5},
    {"type": "string", "maxLength": 5},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    {"type": "string", "pattern": "^(yes|no|maybe)$"},
    {"type": "string", "format": "date"},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    {"const": "fixed"},
    # objects
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"name": S, "nick": S, "age": INT}, required=["name"]),
    obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "ok": {"type": "boolean"}}, required=[]),
    obj({"user": obj({"first": S, "last": S}), "active": {"type": "boolean"}}),
    obj({"a": obj({"b": obj({"c": {"enum": ["x", "y"]}})})}),
    obj({"color": {"enum": ["red", "green"]}, "size": {"enum": ["S", "M", "L"]}, "qty": INT}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "score": {"type": "number", "minimum": 0,
                                                                                "maximum": 100}}),
    # arrays
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {"type": "array", "items": S, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 5},
    {"type": "array", "items": obj({"k": S, "v": INT}), "maxItems": 2},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 5}, S], "items": False},
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}, "title": S}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 3}, "maxItems": 2},
                    "maxItems": 2}}),
    # combinators and references
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, S]},
    {"oneOf": [obj({"kind": {"const": "circle"}, "r": INT}), obj({"kind": {"const": "square"}, "side": INT})]},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
    {"$defs": {"pt": obj({"x": INT, "y": INT})}, "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"},
                                                                             "to": {"$ref": "#/$defs/pt"}},
     "required": ["from", "to"], "additionalProperties": False},
    {"allOf": [obj({"a": INT}, required=["a"], additionalProperties=True), {"maxProperties": 1}]},
]
