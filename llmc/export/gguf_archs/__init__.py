"""GGUF architectures whose files llmc reads itself (`llmc.export.gguf_read.load_model`), where transformers' GGUF
reader reads none or another model: one module per family or group of families, each family module with a `FAMILIES` tuple of
`gguf_read.Family` (the config its keys make, where its weights differ from gguf's name table), read as llama.cpp's
converter (`convert_hf_to_gguf.py`) writes the files and llama.cpp reads them."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def families() -> tuple[Any, ...]:
    """Every family of the package's modules (imported on first use: they build on gguf_read, which asks for them)."""
    return tuple(f for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
                 for f in getattr(importlib.import_module(f"{__name__}.{m.name}"), "FAMILIES", ()))
