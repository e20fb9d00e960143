"""Kimi Linear (Kimi-Linear-48B-A3B Base / Instruct), read as llama.cpp's converter writes it (`KimiLinearModel` in
its conversion/kimi_linear.py; llama.cpp's `kimi-linear`): Kimi Delta Attention layers beside multi-head latent
attention ones (without positions: neither transformers nor llama.cpp rotates Kimi's MLA), a mixture with a shared
expert after a leading dense layer.

- **The layer pattern**: per-layer `attention.head_count_kv`, 0 on a KDA layer (llama.cpp's recurrent layers), 1 on
  an MLA layer — the converter writes the MLA layers as one KV head (its MQA form of the latent cache), so the
  file's KV head count is not the model's: transformers' Kimi Linear has a key and value per query head
  (`num_key_value_heads` = the heads, as every checkpoint).
- **Keys**: the KDA's head size (`kda.head_dim`; its heads are `attention.head_count`, as llama.cpp takes them)
  and convolution (`ssm.conv_kernel`); the MLA's ranks (`attention.kv_lora_rank`, `attention.q_lora_rank`), the
  rotary part of its heads (`rope.dimension_count` = qk_rope_head_dim), `attention.key_length_mla` (nope + rope) and
  `attention.value_length_mla` (`attention.key_length` is kv_lora_rank + rope, the latent cache's); the experts'
  width, count, top-k, shared count (`expert_shared_count`: the shared MLP is that many times the experts' width),
  `leading_dense_block_count` (the dense layers before the mixture), `expert_weights_scale` (routed_scaling_factor),
  `expert_gating_func` (sigmoid), the groups (`expert_group_count`, `expert_group_used_count`).
- **Tensors**: q / k / v as they are (no permute); each KDA convolution (q, k, v apart, [channels, 1, kernel]) as
  [1, channels, 1, kernel] (`ssm_conv1d_q` / `_k` / `_v`; transformers stacks the three); A as -exp(A_log) in
  A_log's [1, 1, heads, 1]; the dt bias as `ssm_dt.bias`; `kv_b_proj` split per head into `attn_k_b` (the keys'
  rows, transposed: [heads, kv_lora_rank, nope]) and `attn_v_b` ([heads, v, kv_lora_rank]) — a file of the first
  converter holds it whole (`attn_kv_b`); the router's correction bias as `exp_probs_b.bias`; each layer's experts
  stacked per projection (w1 / w3 / w2 -> gate / up / down). No norm is stored otherwise than the checkpoint's.

llama.cpp always renormalizes the chosen experts' weights (moe_renormalize, every checkpoint's), runs SiLU MLPs
(`hidden_act` where a file names it), scales MLA by 1 / sqrt(nope + rope). Refused: gating other than sigmoid,
another activation, a latent mixture (`moe_latent_size`), KDA heads other than the attention's."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from llmc.export.gguf_archs.moe_common import experts, layer_of, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config

_SIGMOID = 2  # (llama.cpp's expert_gating_func values)
_CONV = re.compile(r"model\.layers\.(\d+)\.self_attn\.conv1d\.weight")


def _config(g: GGUFFile) -> Any:
    k = g.keys
    n = int(k["block_count"])
    heads = k["attention.head_count"]
    if isinstance(heads, list):
        refuse(g, "attention.head_count", heads, "per layer: transformers' Kimi Linear takes one head count")
    heads = int(heads)
    kv = g.per_layer("attention.head_count_kv", n)
    if len(kv) != n:
        refuse(g, "attention.head_count_kv", kv, f"{len(kv)} values for {n} layers")
    gating = int(k["expert_gating_func"])
    if gating != _SIGMOID:
        refuse(g, "expert_gating_func", gating, "transformers' Kimi Linear routes by sigmoid")
    act = str(k.get("hidden_act", "silu")).lower()
    if act not in ("silu", "swiglu"):
        refuse(g, "hidden_act", act, "transformers' Kimi Linear runs SiLU MLPs")
    if int(k.get("moe_latent_size", 0) or 0):
        refuse(g, "moe_latent_size", k["moe_latent_size"], "transformers' Kimi Linear has no latent mixture")
    rope, mla_k = int(k["rope.dimension_count"]), int(k["attention.key_length_mla"])
    if not 0 <= rope < mla_k:
        refuse(g, "attention.key_length_mla", mla_k, f"not above the rotary part {rope} (rope.dimension_count)")
    kda_head = int(k["kda.head_dim"])
    dt = next((t for name, t in g.tensors.items() if name.endswith(".ssm_dt.bias")), None)
    if dt is not None and int(np.prod(dt.shape)) != kda_head * heads:
        refuse(g, "kda.head_dim", kda_head, f"x {heads} heads is not the dt bias's {int(np.prod(dt.shape))}: "
               "llama.cpp's KDA has as many heads as the attention")
    groups = int(k.get("expert_group_count", 1) or 1)
    q_lora = k.get("attention.q_lora_rank")
    dense = int(k.get("leading_dense_block_count", 0) or 0)
    experts_n = int(k["expert_count"])
    return text_config(
        g, "kimi_linear", num_key_value_heads=heads,
        layer_types=["full_attention" if v else "linear_attention" for v in kv],
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(n)],
        kv_lora_rank=int(k["attention.kv_lora_rank"]), q_lora_rank=int(q_lora) if q_lora else None,
        qk_rope_head_dim=rope, qk_nope_head_dim=mla_k - rope, v_head_dim=int(k["attention.value_length_mla"]),
        linear_head_dim=kda_head, linear_num_heads=heads, linear_conv_kernel_dim=int(k["ssm.conv_kernel"]),
        moe_intermediate_size=int(k["expert_feed_forward_length"]), num_local_experts=experts_n,
        num_experts_per_tok=int(k["expert_used_count"]), n_shared_experts=int(k.get("expert_shared_count", 0) or 0),
        routed_scaling_factor=float(k.get("expert_weights_scale", 1.0) or 1.0), norm_topk_prob=True,
        n_group=groups, topk_group=int(k.get("expert_group_used_count", groups) or groups), hidden_act="silu",
        rms_norm_eps=float(k["attention.layer_norm_rms_epsilon"]), attention_bias=False)


def kv_b(g: GGUFFile, blk: str, config: Any) -> np.ndarray | None:
    """`kv_b_proj` ([heads x (nope + v), kv_lora_rank]) from the converter's `attn_k_b` ([heads, kv_lora_rank,
    nope]: each head's key rows transposed) and `attn_v_b` ([heads, v, kv_lora_rank]), or a first converter's
    `attn_kv_b` (as it is)."""
    if f"{blk}.attn_kv_b.weight" in g.tensors:
        return g.read(f"{blk}.attn_kv_b.weight")
    k_b, v_b = g.read(f"{blk}.attn_k_b.weight"), g.read(f"{blk}.attn_v_b.weight")
    if k_b is None or v_b is None:
        return None
    heads, rank = int(config.num_attention_heads), int(config.kv_lora_rank)
    nope, v = int(config.qk_nope_head_dim), int(config.v_head_dim)
    if k_b.size != heads * rank * nope or v_b.size != heads * v * rank:
        return None  # (mismatched: reported as such)
    k_rows = k_b.reshape(heads, rank, nope).transpose(0, 2, 1)
    return np.concatenate((k_rows, v_b.reshape(heads, v, rank)), axis=1).reshape(heads * (nope + v), rank)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    i = layer_of(key)
    if i is None:
        return None  # (embeddings, final norm, head: gguf's table)
    if (found := experts(key, g)) is not None:
        return found
    blk = f"blk.{i}"
    if _CONV.fullmatch(key):  # (q, k, v apart, each [1, channels, 1, kernel]; transformers stacks them)
        parts = [p for x in "qkv" if (p := g.read(f"{blk}.ssm_conv1d_{x}.weight")) is not None]
        if len(parts) != 3:
            return None
        kernel = int(config.linear_conv_kernel_dim)
        return np.concatenate([p.reshape(-1, 1, kernel) for p in parts])
    if key.endswith("self_attn.forget_gate.A_log"):  # (stored as -exp(A_log), A_log's [1, 1, heads, 1])
        a = g.read(f"{blk}.ssm_a")
        return None if a is None else np.log(-a.astype(np.float64)).astype(np.float32).reshape(1, 1, -1, 1)
    if key.endswith("self_attn.forget_gate.dt_bias"):
        return g.read(f"{blk}.ssm_dt.bias")
    if key.endswith("self_attn.forget_gate.f_a_proj.weight"):
        return g.read(f"{blk}.ssm_f_a.weight")
    if key.endswith("self_attn.forget_gate.f_b_proj.weight"):
        return g.read(f"{blk}.ssm_f_b.weight")
    if key.endswith("self_attn.kv_b_proj.weight"):
        return kv_b(g, blk, config)
    if key.endswith("mlp.gate.e_score_correction_bias"):
        return g.read(f"{blk}.exp_probs_b.bias")
    return None


FAMILIES = (Family("kimi-linear", "kimi_linear", "Kimi Linear", _config, values=_values, rope_freqs=False),)
