"""Granite 3.x (llama.cpp's `granite`, the converter's `GraniteModel`, a `LlamaModel`): Llama's keys without a head
size (the converter drops head_dim: heads are width / heads), the four multipliers as llama.cpp's scales
(`attention.scale`: the queries' scale; `embedding_scale`, `residual_scale`; `logit_scale`: the logits divided by
it), q / k rows reordered for llama.cpp's rotary (`LlamaModel.permute`: undone here). llama.cpp's Granite reads an
absent attention scale as 1 / sqrt(head size), absent embedding and residual scales as none.

Granite 4.0's dense models (`GraniteMoeHybridForCausalLM` with attention layers only) are converted by
`GraniteHybridModel` as `granite` too: the same keys and tensors (the shared MLP split into gate / up), with the KV
head count as one value per layer and `rope.scaling.finetuned` true; llama.cpp's Granite rotates only where that
flag is true (its default), transformers' Granite always: a file saying false is refused."""

from __future__ import annotations

import math
from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import (
    ATTENTION,
    MLP,
    bias_flag,
    kv_heads,
    unpermuted_qk,
    whole_head_rotated,
)
from llmc.export.gguf_read import Family, GGUFFile, text_config


def granite_values(g: GGUFFile, model: str) -> dict[str, Any]:
    """What a Granite file's keys say of a Granite model (`model`: transformers' class, for the refusal): heads of
    width / heads, rotated whole, the KV heads, the four multipliers as llama.cpp reads them (an absent attention
    scale 1 / sqrt(head size), absent embedding and residual scales 1), the biases the file has."""
    k = g.keys
    head = int(k["embedding_length"]) // int(k["attention.head_count"])
    if int(k.get("attention.key_length", head)) != head:  # (the converter drops head_dim)
        raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.key_length {k['attention.key_length']}: "
                                    f"transformers' {model} has heads of width / heads ({head})")
    whole_head_rotated(g, head)
    return dict(num_key_value_heads=kv_heads(g), attention_multiplier=float(k.get("attention.scale") or
                                                                             1 / math.sqrt(head)),
                embedding_multiplier=float(k.get("embedding_scale") or 1.0),
                residual_multiplier=float(k.get("residual_scale") or 1.0), logits_scaling=float(k["logit_scale"]),
                attention_bias=bias_flag(g, ATTENTION, "attention_bias"), mlp_bias=bias_flag(g, MLP, "mlp_bias"))


def _granite(g: GGUFFile) -> Any:
    if not g.keys.get("rope.scaling.finetuned", True):
        raise UnsupportedModelError(f"{g.path}: granite.rope.scaling.finetuned false: llama.cpp's Granite then "
                                    "rotates nothing, transformers' Granite always rotates")
    return text_config(g, "granite", **granite_values(g, "Granite"))


FAMILIES = (Family("granite", "granite", "Granite", _granite, values=unpermuted_qk),)
