"""MiMo-V2-Flash (llama.cpp's `mimo2`, the converter's `MimoV2Model`): `TextModel`'s keys with the three
multi-token-prediction blocks counted in `block_count` (`nextn_predict_layers`; the converter renames
`model.mtp.layers.{i}` to the blocks after the model's), each layer's KV heads as an array (the sliding layers' count
where the checkpoint's `hybrid_layer_pattern` says 1), the window and that pattern as `sliding_window_pattern`, the
values' width (`value_length`, narrower than q / k's `key_length`), the experts' count and width, the rotated dims
(the head size x the checkpoint's partial rotary factor), the values' scale; the weights as they are (llama.cpp
rotates NeoX's way, as transformers does), the sliding layers' sinks as `attn_sinks`, the selection bias as
`exp_probs_b` (zeros where a layer has none: llama.cpp's tensor is optional), each layer's experts stacked per
projection.

llama.cpp's model (src/models/mimo2.cpp) rotates every layer (the sliding layers at `rope.freq_base_swa` where the
file has one, the others at `rope.freq_base`), applies a layer's sinks where the file holds them, scales the
attention's output by `attention.value_scale` (none where the key is missing or 1), and routes by sigmoid with the
selection bias, the chosen weights renormalized and not scaled, over all experts (no groups); a layer without a
router is dense. transformers' MiMo-V2-Flash has the full layers' KV heads doubled on its sliding layers, sinks on
exactly those, one rotated share for both kinds: a file must be that.

Refused: sliding layers' KV heads not twice the full layers', sinks on a full layer or missing from a sliding one,
expert groups (llama.cpp ignores them; transformers' MiMo would group), per-layer query heads that differ."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.export.gguf_archs.moe_common import layer_of, moe_values, refuse
from llmc.export.gguf_archs.moe_exaone import rope_base
from llmc.export.gguf_read import Family, GGUFFile, rotated_share, text_config

BIAS = "mlp.gate.e_score_correction_bias"


def _config(g: GGUFFile) -> Any:
    k = g.keys
    n = g.layers()
    heads = g.per_layer("attention.head_count", n)
    if len(set(heads)) != 1:
        refuse(g, "attention.head_count", k["attention.head_count"], "transformers' MiMo-V2-Flash has one query head "
               "count")
    sliding = [bool(s) for s in g.per_layer("attention.sliding_window_pattern", n)]
    kv = g.per_layer("attention.head_count_kv", n)
    full_kv = {c for c, s in zip(kv, sliding, strict=True) if not s}
    swa_kv = {c for c, s in zip(kv, sliding, strict=True) if s}
    base_kv = next(iter(full_kv)) if full_kv else next(iter(swa_kv)) // 2
    if len(full_kv) > 1 or swa_kv - {2 * base_kv}:
        refuse(g, "attention.head_count_kv", k["attention.head_count_kv"], "transformers' MiMo-V2-Flash has twice "
               "the full layers' KV heads on each sliding layer")
    sinks = [f"blk.{i}.attn_sinks.weight" in g.tensors for i in range(n)]
    if sinks != sliding:
        refuse(g, "attention.sliding_window_pattern", k["attention.sliding_window_pattern"], "transformers' "
               "MiMo-V2-Flash has sinks on exactly its sliding layers; the file's attn_sinks are on layers "
               f"{[i for i in range(n) if sinks[i]]}")
    if int(k.get("expert_group_count", 1) or 1) > 1:
        refuse(g, "expert_group_count", k["expert_group_count"], "llama.cpp's MiMo-V2 routes over all experts, "
               "transformers' would take groups")
    head = int(k["attention.key_length"])
    factor = rotated_share(g, head, "MiMo-V2-Flash")
    scale = k.get("attention.value_scale")
    config = text_config(
        g, "mimo_v2_flash", num_hidden_layers=n, head_dim=head, v_head_dim=int(k["attention.value_length"]),
        num_attention_heads=heads[0], num_key_value_heads=base_kv, hidden_act="silu", attention_bias=False,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        mlp_layer_types=["sparse" if f"blk.{i}.ffn_gate_inp.weight" in g.tensors else "dense" for i in range(n)],
        sliding_window=int(k["attention.sliding_window"]), n_routed_experts=int(k["expert_count"]),
        num_experts_per_tok=int(k["expert_used_count"]), moe_intermediate_size=int(k["expert_feed_forward_length"]),
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        attention_value_scale=1.0 if scale is None else float(scale),
        rope_parameters={kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
                         for kind, theta in (("full_attention", float(k.get("rope.freq_base", 10_000.0))),
                                             ("sliding_attention", rope_base(g)))})
    return config


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """The experts, the router and its selection bias (`exp_probs_b`; zeros where a layer's is missing, as llama.cpp
    then selects by the scores alone), the sinks; None for the rest."""
    found = moe_values(key, g, BIAS)
    i = layer_of(key)
    if i is not None and key.endswith("self_attn.sinks"):  # (the name table's name has no `.weight`)
        return g.read(f"blk.{i}.attn_sinks.weight")
    if found is None and i is not None and key.endswith(BIAS) and f"blk.{i}.exp_probs_b.bias" not in g.tensors:
        return np.zeros(config.n_routed_experts, dtype=np.float32)
    return found


FAMILIES = (Family("mimo2", "mimo_v2_flash", "MiMo-V2-Flash", _config, values=_values),)
