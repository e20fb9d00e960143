"""Laguna (Poolside's; llama.cpp's `laguna`, the converter's `LagunaModel`, a bare `TextModel`): `TextModel`'s keys
(the rotary base and scaling from the checkpoint's full layers' `rope_parameters`, the sliding layers' base as
`rope.freq_base_swa`), the query heads as an array of one count per layer (`num_attention_heads_per_layer`, the one
count repeated without it), the vocabulary size, the window where the checkpoint has one (none written without it),
the experts' and the shared expert's widths, the routing's renormalization (always) and scale
(`moe_routed_scaling_factor`), sigmoid gating (always), the leading dense layers (the run of `dense` that
`mlp_layer_types` begins with), the rotated dims of the full and of the sliding layers (the head size x each layer
type's partial rotary factor); the weights as they are (llama.cpp rotates NeoX's way, as transformers does), each
layer's experts stacked per projection, the selection bias (the checkpoint's `mlp.experts.e_score_correction_bias`) as
`exp_probs_b.bias`, the output gate (`g_proj`) as `attn_gate`. Not written: the checkpoint's `layer_types`, its
`gating` (the gate's width tells it), `moe_router_logit_softcapping`. gguf's package names no `laguna` tensors yet:
the file follows Step-3.5's name table (the same products, q / k norms, head-wise gate, routed and shared experts).

llama.cpp's model (src/models/laguna.cpp) norms q and k per head, gates the attention's output by
softplus(attn_gate x) before `attn_output` (one gate per head where the gate is as wide as the layer's heads, one per
element where it is heads x head size), routes by the sigmoid with the selection bias (`expert_gating_func`, sigmoid
where none is written), renormalized where `expert_weights_norm`, scaled by `expert_weights_scale` (0 or 1: not),
adds the shared expert (no gate, `expert_shared_count` unread) and runs dense MLPs before
`leading_dense_block_count`. With a window (`attention.sliding_window` > 0) it slides every layer but each period's
first (`set_swa_pattern(period, dense_first)`: the period a scalar `attention.sliding_window_pattern`, 4 without one;
llama.cpp's scalar read passes over an array), rotating those `rope.dimension_count_swa` dims (the full layers' count
without it) at `rope.freq_base_swa` (the file's base without it), unscaled; without a window every layer is full.
The full layers rotate `rope.dimension_count` dims at `rope.freq_base` with the file's scaling (yarn: the factor and
original context; llama.cpp's Laguna reads none of the `rope.scaling.yarn_*` keys, so yarn's betas are 32 / 1 and its
magnitude 0.1 ln(factor) + 1, transformers' yarn without an attention factor). That is transformers' Laguna with the
layer types of that pattern, each layer type's own rotary table, the per-layer heads and `gating` from the gates'
widths, the routed scale as `moe_routed_scaling_factor` and no router soft-cap (which the converter drops).

Refused, where transformers' Laguna cannot compute what llama.cpp does or the file says what llama.cpp does not read:
softmax gating and unrenormalized weights (transformers' always routes by the sigmoid, renormalized), expert groups
(llama.cpp routes within them; transformers' over all experts), KV heads that differ between layers, a pattern array
that is not the period llama.cpp runs, gates of both widths (or of neither, or missing: transformers' has one kind
for every layer), yarn betas other than 32 / 1 or a yarn attention factor other than its magnitude (read by
transformers, not by llama.cpp), `rope.scaling.attn_factor` other than 1 (no place in transformers' Laguna), a rotated
share transformers cannot rotate."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import kv_heads
from llmc.export.gguf_archs.moe_common import bias_values, refuse, sigmoid_renormalized
from llmc.export.gguf_archs.moe_exaone import rope_base
from llmc.export.gguf_read import Family, GGUFFile, _scaled_rope, rotated_share, text_config, unread_yarn

BIAS = "mlp.gate.e_score_correction_bias"
PERIOD = 4  # (llama.cpp's Laguna's sliding period where the file gives none)


def _sliding(g: GGUFFile, n: int) -> list[bool]:
    """Which of `n` layers slide, as llama.cpp's Laguna marks them: none without a window; else every layer but each
    period's first, the period a scalar `attention.sliding_window_pattern` (4 without one or for an array, which
    llama.cpp does not read: an array that is not that pattern is refused)."""
    if int(g.keys.get("attention.sliding_window", 0) or 0) <= 0:
        return [False] * n
    key = "attention.sliding_window_pattern"
    value = g.keys.get(key)
    period = int(value) if value is not None and not isinstance(value, list) else PERIOD
    sliding = [period == 0 or i % period != 0 for i in range(n)]
    if isinstance(value, list) and [bool(v) for v in value[:n]] != sliding:
        refuse(g, key, value, f"llama.cpp's Laguna slides every layer but the first of each {period}, whatever the "
               "array says")
    return sliding


def _full_rope(g: GGUFFile, head: int) -> dict[str, Any]:
    """The full layers' rotary parameters: the base, the rotated share, the file's scaling as llama.cpp's Laguna
    takes it (yarn's betas and magnitude its own: a file saying otherwise is refused)."""
    k = g.keys
    keys = unread_yarn(g, "Laguna")
    return {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 10_000.0)),
            "partial_rotary_factor": rotated_share(g, head, "Laguna"),
            **_scaled_rope(keys, g.tensors, g.path, g.arch)}


def _gating(g: GGUFFile, heads: list[int], head: int) -> bool | str:
    """transformers' `gating` from the width of each layer's `attn_gate` (as llama.cpp tells them apart): True for a
    gate per head, "per-element" for one per element; both kinds, another width or none is refused."""
    widths = [int(t.shape[-1]) if (t := g.tensors.get(f"blk.{i}.attn_gate.weight")) is not None else None
              for i in range(len(heads))]
    kinds = {"per-head" if w == h else "per-element" if w == h * head else None for w, h in zip(widths, heads,
                                                                                                strict=True)}
    if len(kinds) != 1 or None in kinds:
        raise UnsupportedModelError(f"{g.path}: attn_gate widths {widths} for layers of {heads} heads of {head}: "
                                    "transformers' Laguna gates every layer per head or every layer per element")
    return True if kinds == {"per-head"} else "per-element"


def _config(g: GGUFFile) -> Any:
    k = g.keys
    sigmoid_renormalized(g, "Laguna")
    if int(k.get("expert_group_count", 1) or 1) > 1:
        refuse(g, "expert_group_count", k["expert_group_count"], "llama.cpp routes within expert groups, "
               "transformers' Laguna over all experts")
    n = g.layers()
    heads = g.per_layer("attention.head_count", n)
    kv = kv_heads(g)
    if kv is None:
        raise KeyError("attention.head_count_kv")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // heads[0])
    sliding = _sliding(g, n)
    rope: dict[str, Any] = {}
    if not all(sliding):
        rope["full_attention"] = _full_rope(g, head)
    if any(sliding):
        rope["sliding_attention"] = {"rope_type": "default", "rope_theta": rope_base(g),
                                     "partial_rotary_factor": rotated_share(g, head, "Laguna",
                                                                            "rope.dimension_count_swa")}
    dense = int(k["leading_dense_block_count"])
    return text_config(
        g, "laguna", num_hidden_layers=n, head_dim=head, num_attention_heads=heads[0],
        num_attention_heads_per_layer=heads, num_key_value_heads=kv, hidden_act="silu", attention_bias=False,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(n)], gating=_gating(g, heads, head),
        num_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
        moe_intermediate_size=int(k["expert_feed_forward_length"]),
        shared_expert_intermediate_size=int(k["expert_shared_feed_forward_length"]),
        moe_routed_scaling_factor=float(k.get("expert_weights_scale", 0.0) or 1.0), moe_router_logit_softcapping=0.0,
        rope_parameters=rope)


FAMILIES = (Family("laguna", "laguna", "Laguna", _config, values=bias_values(BIAS), table="step35"),)
