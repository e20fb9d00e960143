"""Granite MoE and Granite MoE with a shared expert (llama.cpp's `granitemoe` for both, the converter's
`GraniteMoeModel` < `GraniteModel` < `LlamaModel`): `TextModel`'s keys without the head size (Granite's converter
drops it), the vocabulary size, the rotated dims, Granite's four multipliers as `attention.scale`,
`embedding_scale`, `residual_scale` and `logit_scale` (each written only where the checkpoint's is non-zero: llama.cpp
then takes 1 / sqrt(head size) for the attention's and 1 for the others), and the shared expert's width
(`expert_shared_feed_forward_length`: a file with it is a GraniteMoeShared model). q / k rows permuted for llama.cpp's
rotary (`LlamaModel.permute`); the fused `input_linear` experts split into `ffn_gate_exps` / `ffn_up_exps`; the
shared MLP's fused `input_linear` into `ffn_gate_shexp` / `ffn_up_shexp`."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.export.gguf_archs.moe_common import experts, layer_of, refuse, rows
from llmc.export.gguf_read import Family, GGUFFile, text_config, unpermute


def _config(g: GGUFFile) -> Any:
    k = g.keys
    if k.get("rope.scaling.finetuned", True) is False:  # (Granite's switch for no rotary at all)
        refuse(g, "rope.scaling.finetuned", False, "a Granite MoE without rotary positions, which transformers' has not")
    head = int(k["embedding_length"]) // int(k["attention.head_count"])
    if int(k.get("rope.dimension_count", head)) != head:
        refuse(g, "rope.dimension_count", k["rope.dimension_count"], f"transformers' Granite MoE rotates all {head} dims")
    shared = int(k.get("expert_shared_feed_forward_length", 0))
    fields: dict[str, Any] = dict(
        num_local_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
        attention_multiplier=float(k.get("attention.scale") or head ** -0.5),
        embedding_multiplier=float(k.get("embedding_scale") or 1.0),
        residual_multiplier=float(k.get("residual_scale") or 1.0),
        logits_scaling=float(k["logit_scale"] or 1.0),
        attention_bias="blk.0.attn_q.bias" in g.tensors)
    if shared:
        fields["shared_intermediate_size"] = shared
    return text_config(g, "granitemoeshared" if shared else "granitemoe", **fields)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    if (found := experts(key, g)) is not None:
        return found
    i = layer_of(key)
    if i is None:
        return None
    if key.endswith("shared_mlp.input_linear.weight"):
        return rows(g, f"blk.{i}.ffn_gate_shexp.weight", f"blk.{i}.ffn_up_shexp.weight")
    for kind, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads)):
        if key.endswith((f"{kind}_proj.weight", f"{kind}_proj.bias")):
            values = g.named(key)
            return None if values is None else unpermute(values, int(heads))
    return None


FAMILIES = (Family("granitemoe", "granitemoe", "Granite MoE", _config, values=_values),)
