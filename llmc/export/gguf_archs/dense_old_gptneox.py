"""GPT-NeoX / Pythia (llama.cpp's `gptneox`, the converter's `GPTNeoXModel`): its own keys only (the context, the
width, layers, the MLP width, the rotated dims per head, heads, the parallel residual, the LayerNorm epsilon; no
KV heads, no rotary base: 10,000 as the checkpoints have it); the fused q / k / v rows (and bias), one group of
query, key, value per head in the checkpoint, regrouped into all the queries, all the keys, all the values. The
activation is Pythia's exact GELU (llama.cpp computes its tanh form; GPT-NeoX-20B's own is gelu_fast)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_read import Family, GGUFFile, _scaled_rope, rotated_share, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    width, heads = int(k["embedding_length"]), int(k["attention.head_count"])
    if int(k.get("attention.head_count_kv", heads)) != heads:
        raise UnsupportedModelError(f"{g.path}: gptneox.attention.head_count_kv {k['attention.head_count_kv']} "
                                    f"for {heads} heads: GPT-NeoX's keys and values have a head per query head")
    head = width // heads
    factor = rotated_share(g, head, "GPT-NeoX")
    if "rope_freqs.weight" in g.tensors:
        raise UnsupportedModelError(f"{g.path}: rope_freqs.weight: llama.cpp's GPT-NeoX has no rotary factors")
    rope = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 10000.0)),
            "partial_rotary_factor": factor, **_scaled_rope(k, g.tensors, g.path, g.arch)}
    return text_config(g, "gpt_neox", rope_parameters=rope, hidden_act="gelu",
                       use_parallel_residual=bool(k["use_parallel_residual"]),  # (llama.cpp requires the key)
                       attention_bias="blk.0.attn_qkv.bias" in g.tensors)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """A layer's fused q / k / v rows (or bias) from the file's [all queries; all keys; all values] back into the
    checkpoint's groups of (query, key, value) per head."""
    if not key.endswith(("attention.query_key_value.weight", "attention.query_key_value.bias")):
        return None
    rows = g.named(key)
    if rows is None:
        return None
    heads = int(config.num_attention_heads)
    if rows.shape[0] % (3 * heads):
        return rows  # (not the model's: refused as mismatched)
    return rows.reshape(3, heads, rows.shape[0] // 3 // heads, *rows.shape[1:]).swapaxes(0, 1).reshape(rows.shape)


FAMILIES = (Family("gptneox", "gpt_neox", "GPT-NeoX", _config, values=_values, rope_freqs=False),)
