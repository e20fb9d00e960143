"""DeepSeek-V2 / V2-Lite / V2.5 and DeepSeek-V3 / R1 / Kimi K2 (llama.cpp's `deepseek2`, the converter's
`DeepseekV2Model`): `TextModel`'s keys with one KV head (latent attention written as MQA), the leading dense layers,
the vocabulary size, the latent ranks (`attention.q_lora_rank` where the queries have one, `attention.kv_lora_rank`),
the heads' sizes as MLA sees them (`attention.key_length_mla` / `value_length_mla`; older converters wrote them as
`key_length` / `value_length`), the rotated dims, the experts' width / count / shared count / weights' scale and
norm, groups and gating function, yarn's `mscale_all_dim` as 0.1 x it (`rope.scaling.yarn_log_multiplier`). Each
layer's experts stacked per projection; `kv_b_proj` split per head into `attn_k_b` (the keys' part, transposed to
[rank, nope]) and `attn_v_b` (older converters: `attn_kv_b` whole); q / k not permuted (llama.cpp rotates DeepSeek's
interleaved pairs as they are).

The model is DeepSeek-V3's where the file routes by sigmoid with a selection bias (`exp_probs_b`), V2's where it
routes by softmax: llama.cpp's routing (src/models/deepseek2.cpp, build_moe_ffn) is V3's (groups scored by their top
two) or V2's greedy top-k, scaled by `expert_weights_scale`, renormalized where `expert_weights_norm`. Its yarn keeps
the rotated dims unscaled and scales q.k by (1 + 0.1 mscale_all_dim ln factor)^2, as transformers' DeepSeek does with
`attention_factor` 1 and the checkpoint's `mscale_all_dim`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from llmc.export.gguf_archs.moe_common import layer_of, moe_values, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config

SOFTMAX, SIGMOID = 1, 2  # (llama.cpp's expert_gating_func values)


def _rope(g: GGUFFile) -> dict[str, Any]:
    k = g.keys
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 10000.0))}
    kind = k.get("rope.scaling.type", "none")
    if kind == "none":
        return rope
    if kind != "yarn":
        refuse(g, "rope.scaling.type", kind, "llama.cpp's DeepSeek rotary is plain or yarn")
    for knob, default in (("yarn_ext_factor", -1.0), ("yarn_attn_factor", 1.0)):
        if float(k.get(f"rope.scaling.{knob}", default)) != default:
            refuse(g, f"rope.scaling.{knob}", k[f"rope.scaling.{knob}"], "llmc reads DeepSeek's yarn factor, original "
                   "context, betas and log multiplier only")
    rope.update(rope_type="yarn", factor=float(k["rope.scaling.factor"]),
                original_max_position_embeddings=int(k["rope.scaling.original_context_length"]),
                beta_fast=float(k.get("rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(k.get("rope.scaling.yarn_beta_slow", 1.0)))
    if "rope.scaling.yarn_log_multiplier" in k:  # (0.1 x mscale_all_dim: llama.cpp divides it back)
        rope.update(mscale_all_dim=float(k["rope.scaling.yarn_log_multiplier"]) / 0.1, attention_factor=1.0)
    else:  # (llama.cpp: the rotated dims and q.k each by 1 + 0.1 ln factor)
        rope.update(mscale_all_dim=1.0, attention_factor=0.1 * math.log(float(k["rope.scaling.factor"])) + 1.0)
    return rope


def mla_config(g: GGUFFile) -> Any:
    """DeepSeek-V2's or V3's config from a `deepseek2` file's keys (also the base of its converter's subclasses':
    GLM-5's, DeepSeek-V3.2's, moe_dsa)."""
    k = g.keys
    rope_dim = int(k["rope.dimension_count"])
    if "attention.key_length_mla" in k:
        head_k, head_v = int(k["attention.key_length_mla"]), int(k["attention.value_length_mla"])
    else:  # (the converters before MLA's split: the heads' sizes as key_length / value_length)
        head_k, head_v = int(k["attention.key_length"]), int(k["attention.value_length"])
    gating = int(k.get("expert_gating_func", SOFTMAX))
    biased = any(n.endswith("exp_probs_b.bias") for n in g.tensors)
    groups, used = int(k.get("expert_group_count", 1) or 1), int(k.get("expert_group_used_count", 1) or 1)
    norm = bool(k.get("expert_weights_norm", False))
    if gating not in (SOFTMAX, SIGMOID):
        refuse(g, "expert_gating_func", gating, "DeepSeek routes by softmax (V2) or sigmoid (V3)")
    v3 = gating == SIGMOID
    if v3 != biased:
        refuse(g, "expert_gating_func", gating, f"{'sigmoid' if v3 else 'softmax'} routing "
               f"{'without' if v3 else 'with'} a selection bias (exp_probs_b): transformers' DeepSeek V2 routes by "
               "softmax without one, V3 by sigmoid with one")
    if not v3 and norm:
        refuse(g, "expert_weights_norm", True, "transformers' DeepSeek V2 does not renormalize its softmax top-k")
    if not v3 and 1 < groups and used < groups:
        refuse(g, "expert_group_count", groups, f"llama.cpp scores {groups} groups by their top two experts, "
               "transformers' DeepSeek V2 by their best one")
    n_experts = int(k["expert_count"])
    fields: dict[str, Any] = dict(
        num_key_value_heads=int(k["attention.head_count"]), head_dim=rope_dim, qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=head_k - rope_dim, v_head_dim=head_v, kv_lora_rank=int(k["attention.kv_lora_rank"]),
        q_lora_rank=int(k["attention.q_lora_rank"]) if k.get("attention.q_lora_rank") else None,
        first_k_dense_replace=int(k.get("leading_dense_block_count", 0)), n_routed_experts=n_experts,
        num_experts_per_tok=int(k["expert_used_count"]), n_shared_experts=int(k.get("expert_shared_count", 0)),
        moe_intermediate_size=int(k["expert_feed_forward_length"]),
        routed_scaling_factor=float(k.get("expert_weights_scale", 1.0) or 1.0), norm_topk_prob=norm,
        n_group=groups, topk_group=used, rope_parameters=_rope(g), attention_bias=False)
    if v3:  # (the rotary `_rope` reads, yarn's log multiplier among it: text_config leaves a given one alone)
        return text_config(g, "deepseek_v3", rope_interleave=True, **fields)
    return text_config(g, "deepseek_v2", topk_method="greedy", **fields)


def mla_values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """A weight as the model has it: the experts from their stacks, the selection bias, `kv_b` joined back from
    `k_b` / `v_b`."""
    if (found := moe_values(key, g, "mlp.gate.e_score_correction_bias")) is not None:
        return found
    i = layer_of(key)
    if i is None or not key.endswith("self_attn.kv_b_proj.weight"):
        return None
    if f"blk.{i}.attn_kv_b.weight" in g.tensors:
        return g.read(f"blk.{i}.attn_kv_b.weight")
    k_b, v_b = g.read(f"blk.{i}.attn_k_b.weight"), g.read(f"blk.{i}.attn_v_b.weight")
    if k_b is None or v_b is None:
        return None
    heads = int(config.num_attention_heads)  # [H, rank, nope] and [H, v, rank] -> [H * (nope + v), rank]
    k_b = k_b.reshape(heads, int(config.kv_lora_rank), -1).transpose(0, 2, 1)
    v_b = v_b.reshape(heads, -1, int(config.kv_lora_rank))
    return np.concatenate((k_b, v_b), axis=1).reshape(-1, int(config.kv_lora_rank))


FAMILIES = (Family("deepseek2", "deepseek_v2", "DeepSeek-V2 / V3", mla_config, values=mla_values, rope_freqs=False),)
