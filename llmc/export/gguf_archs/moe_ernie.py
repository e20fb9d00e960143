"""ERNIE 4.5 MoE (21B-A3B, 300B-A47B; llama.cpp's `ernie4_5-moe`, the converter's `Ernie4_5MoeModel`):
`TextModel`'s keys, the experts' count / top-k / width, the MoE layers' step (`interleave_moe_layer_step`) and
first one (`leading_dense_block_count`), the shared experts' count and width (written as the checkpoint's
intermediate_size // KV heads, which is theirs in every published checkpoint); q / k as they are (llama.cpp
rotates ERNIE's interleaved pairs, as transformers does); the fused qkv / up-gate products of Paddle checkpoints
split as transformers holds them; the selection bias (`moe_statics`) as `exp_probs_b`; the MTP layers left out;
each layer's experts stacked per projection.

llama.cpp routes by softmax, selects by the probabilities plus the bias and renormalizes the chosen ones
(src/models/ernie4-5-moe.cpp), as transformers' ERNIE 4.5 MoE does; a layer is MoE from the first MoE layer on
at every step-th layer, to the last (transformers' moe_layer_end_index)."""

from __future__ import annotations

from typing import Any

from llmc.export.gguf_archs.moe_common import bias_values, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    n = int(k["block_count"])
    width = int(k["expert_feed_forward_length"])
    shared_width = int(k.get("expert_shared_feed_forward_length", 0) or 0)
    shared = int(k.get("expert_shared_count", 0) or 0) if shared_width > 0 else 0  # (llama.cpp: by the width)
    if shared and shared_width != shared * width:
        refuse(g, "expert_shared_feed_forward_length", shared_width, f"transformers' ERNIE 4.5 MoE has {shared} "
               f"shared experts {shared * width} wide ({shared} x expert_feed_forward_length {width})")
    step = int(k["interleave_moe_layer_step"])
    if step < 1:
        refuse(g, "interleave_moe_layer_step", step, "not a step")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    return text_config(g, "ernie4_5_moe", head_dim=head, moe_num_experts=int(k["expert_count"]), moe_k=int(k["expert_used_count"]),
                       moe_intermediate_size=width, moe_num_shared_experts=shared,
                       moe_layer_start_index=int(k.get("leading_dense_block_count", 0)), moe_layer_interval=step,
                       moe_layer_end_index=n - 1, use_bias=False, hidden_act="silu")


FAMILIES = (Family("ernie4_5-moe", "ernie4_5_moe", "ERNIE 4.5 MoE", _config,
                   values=bias_values("mlp.gate.moe_statics.e_score_correction_bias")),)
