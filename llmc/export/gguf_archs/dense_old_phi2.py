"""Phi-1.5 / Phi-2 (llama.cpp's `phi2`, the converter's `Phi2Model`): its own keys only (the context, the width, 4 x
the width as the MLP's, heads, KV heads = heads, the LayerNorm epsilon, the rotated dims per head; no rotary base:
10,000 as the checkpoints have it); the weights as they are, by gguf's name table. Files converted from Microsoft's
first Phi-2 format (`mixer.Wqkv`, TheBloke's among them) hold q / k / v as one `attn_qkv` (queries, keys, values
rows), which llama.cpp's Phi-2 takes as well. The activation is the checkpoints' gelu_new (llama.cpp's GELU)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_read import Family, GGUFFile, _scaled_rope, rotated_share, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    width, heads = int(k["embedding_length"]), int(k["attention.head_count"])
    kv = int(k.get("attention.head_count_kv", heads))
    if kv < 1 or heads % kv:
        raise UnsupportedModelError(f"{g.path}: phi2.attention.head_count_kv {kv} for {heads} heads")
    head = width // heads
    factor = rotated_share(g, head, "Phi")
    if "rope_freqs.weight" in g.tensors:
        raise UnsupportedModelError(f"{g.path}: rope_freqs.weight: llama.cpp's Phi-2 has no rotary factors")
    rope = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 10000.0)),
            "partial_rotary_factor": factor, **_scaled_rope(k, g.tensors, g.path, g.arch)}
    return text_config(g, "phi", num_key_value_heads=kv, rope_parameters=rope, hidden_act="gelu_new",
                       qk_layernorm=False)


_SPLIT = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """q / k / v from a fused `attn_qkv` (weight and bias) where the file has one instead of `attn_q` / `_k` /
    `_v`: its rows are the queries, the keys, the values."""
    parts = key.split(".")
    if len(parts) != 6 or parts[1] != "layers" or parts[4] not in _SPLIT:
        return None
    fused = f"blk.{parts[2]}.attn_qkv.{parts[5]}"
    if fused not in g.tensors:
        return None
    rows = g.read(fused)
    width = int(config.hidden_size)
    kv = int(config.num_key_value_heads) * (width // int(config.num_attention_heads))
    if rows is None or rows.shape[0] != width + 2 * kv:
        return None
    start = (0, width, width + kv)[_SPLIT[parts[4]]]
    return rows[start:start + (width if parts[4] == "q_proj" else kv)]


FAMILIES = (Family("phi2", "phi", "Phi-2", _config, values=_values, rope_freqs=False),)
