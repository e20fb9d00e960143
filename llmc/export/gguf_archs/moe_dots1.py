"""dots.llm1 (llama.cpp's `dots1`, the converter's `Dots1Model`, a `Qwen2MoeModel`): `TextModel`'s keys (the routed
experts' count as `expert_count`), the experts' width, the leading dense layers, the shared experts' count, the
weights' scale and renormalization, sigmoid routing (the checkpoint's `noaux_tc`) with its selection bias
(`exp_probs_b`); q / k as they are (llama.cpp rotates dots' halves, NeoX's way, as transformers does), their
per-head norms before the rotary; each layer's experts stacked per projection, the shared experts under their own
names.

llama.cpp's dots1 (src/models/dots1.cpp) has no sliding window (the checkpoints' `use_sliding_window` is false):
every layer attends in full, as the config here says; the experts' groups (`expert_group_count`, 1 in the
checkpoints) are scored by their top two, as transformers' dots1 scores them.

Refused: softmax routing (the converter writes sigmoid only)."""

from __future__ import annotations

from typing import Any

from llmc.export.gguf_archs.moe_common import bias_values, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config

SOFTMAX, SIGMOID = 1, 2  # (llama.cpp's expert_gating_func values)


def _config(g: GGUFFile) -> Any:
    k = g.keys
    gating = int(k.get("expert_gating_func", SOFTMAX) or SOFTMAX)  # (llama.cpp's default: softmax)
    if gating != SIGMOID:
        refuse(g, "expert_gating_func", gating, "transformers' dots1 routes by sigmoid")
    n = int(k["block_count"])
    groups = int(k.get("expert_group_count", 1) or 1)
    return text_config(
        g, "dots1", hidden_act="silu", attention_bias=False, sliding_window=None,
        layer_types=["full_attention"] * n, max_window_layers=n, n_routed_experts=int(k["expert_count"]),
        num_experts_per_tok=int(k["expert_used_count"]), moe_intermediate_size=int(k["expert_feed_forward_length"]),
        n_shared_experts=int(k.get("expert_shared_count", 0)),
        first_k_dense_replace=int(k.get("leading_dense_block_count", 0)),
        routed_scaling_factor=float(k["expert_weights_scale"]), norm_topk_prob=bool(k.get("expert_weights_norm", False)),
        n_group=groups, topk_group=int(k.get("expert_group_used_count", groups) or groups))


FAMILIES = (Family("dots1", "dots1", "dots.llm1", _config, values=bias_values("mlp.gate.e_score_correction_bias")),)
