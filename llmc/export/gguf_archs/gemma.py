"""Gemma 1 (llama.cpp's `gemma`, the converter's `GemmaModel`): `TextModel`'s keys without the rotary base (10,000,
as the checkpoints have it), the head size as `key_length`, norms stored as 1 + w, the head tied."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.export.gguf_read import Family, GGUFFile, text_config


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    if key.endswith("norm.weight"):  # (stored as 1 + w: llama.cpp's norm multiplies by the weight alone)
        values = g.named(key)
        return None if values is None else values - 1
    return None


FAMILIES = (Family("gemma", "gemma", "Gemma", lambda g: text_config(g, "gemma"), values=_values),)
