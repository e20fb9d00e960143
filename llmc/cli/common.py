"""Choices and helpers shared by several commands."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from llmc.errors import InputError

# Options several commands take, declared once.
Threads = Annotated[int, typer.Option(help="Threads (0 = physical cores).")]
KVBudgetMB = Annotated[int, typer.Option(help="Memory for the KV cache.")]
ChatTemplate = Annotated[Path | None, typer.Option(help="Jinja chat template file.")]


class Dtype(str, Enum):
    float32 = "float32"
    float16 = "float16"


def read_json_schema(path: Path) -> dict[str, Any]:
    """A JSON schema file (for --json-schema), or an InputError naming the file and what is wrong with it."""
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"cannot read the JSON schema file {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"the JSON schema file {path} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InputError(f"the JSON schema file {path} must hold an object, got {type(schema).__name__}")
    return schema
