"""Phi-3.5-MoE (llama.cpp's `phimoe`, the converter's `PhiMoeModel` < `Phi3MiniModel`): Phi-3's keys (the norms'
epsilon as `layer_norm_rms_epsilon`, the rotated dims, the window, 0 for none; longrope's factors as
`rope_factors_long` / `rope_factors_short` and its attention factor `rope.scaling.attn_factor`), the experts' count and
top-k; the checkpoint's per-expert w1 / w3 / w2 stacked as `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`; q / k
/ v as they are (no permute), the norms' biases, the head's bias.

Read as transformers' Phimoe model, which is the checkpoint's: its LayerNorms and sparsemixer routing. llama.cpp's
phi3 graph (src/models/phi3.cpp) computes otherwise from the same file: RMS norms plus the bias, softmax top-k
renormalized, no window (it disables Phi's). longrope's attention factor is the file's for short and long factors
alike (llama.cpp's `attn_factor`), where the checkpoint has its own short / long mscale."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.export.gguf_archs.moe_common import experts, refuse
from llmc.export.gguf_read import Family, GGUFFile, _scaled_rope, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 1e6))}
    rope.update(_scaled_rope(k, g.tensors, g.path, g.arch))
    if rope["rope_type"] == "longrope":  # (transformers' Phimoe scales cos / sin by its own mscale keys)
        factor = float(rope.pop("attention_factor", 1.0))
        rope.update(short_mscale=factor, long_mscale=factor)
    head = int(k["embedding_length"]) // int(k["attention.head_count"])
    if int(k.get("rope.dimension_count", head)) != head:
        refuse(g, "rope.dimension_count", k["rope.dimension_count"], f"transformers' Phimoe rotates all {head} dims")
    return text_config(g, "phimoe", num_local_experts=int(k["expert_count"]),
                       num_experts_per_tok=int(k["expert_used_count"]), sliding_window=None,
                       attention_bias="blk.0.attn_q.bias" in g.tensors, lm_head_bias="output.bias" in g.tensors,
                       rope_parameters=rope)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    return experts(key, g)


FAMILIES = (Family("phimoe", "phimoe", "Phi-3.5-MoE", _config, values=_values),)
