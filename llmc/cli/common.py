"""Choices and helpers shared by several commands."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

# Options several commands take, declared once.
Threads = Annotated[int, typer.Option(help="Threads (0 = physical cores).")]
KVBudgetMB = Annotated[int, typer.Option(help="Memory for the KV cache.")]
ChatTemplate = Annotated[Path | None, typer.Option(help="Jinja chat template file.")]


class Dtype(str, Enum):
    float32 = "float32"
    float16 = "float16"


