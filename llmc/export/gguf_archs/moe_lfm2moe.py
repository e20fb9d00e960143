"""LFM2-8B-A1B / LFM2-24B-A2B (llama.cpp's `lfm2moe`, the converter's `LFM2MoeModel`): `TextModel`'s keys with the
KV heads per layer (0 on a short-convolution layer: which layers attend), the experts' count, width and top-k, the
leading dense layers, sigmoid gating, the vocabulary size, the convolutions' cache length; the convolutions' taps
squeezed to [hidden, L] (transformers' [hidden, 1, L]), the selection bias (`expert_bias`) as `exp_probs_b.bias`,
each layer's experts stacked per projection; q / k as they are (llama.cpp rotates LFM2's halves, NeoX's way, as
transformers does).

llama.cpp routes by the file's gating function, selects by the scores plus the bias and renormalizes the chosen
ones without scaling them (src/models/lfm2.cpp), as the checkpoints do (norm_topk_prob, routed_scaling_factor 1).

Refused: softmax routing, a sliding window, attention layers of different KV head counts (transformers' LFM2-MoE
has none of them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.export.gguf_archs.moe_common import layer_of, moe_values, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config

SOFTMAX, SIGMOID = 1, 2  # (llama.cpp's expert_gating_func values)


def _config(g: GGUFFile) -> Any:
    k = g.keys
    n = int(k["block_count"])
    gating = int(k["expert_gating_func"])
    if gating != SIGMOID:
        refuse(g, "expert_gating_func", gating, "transformers' LFM2-MoE routes by sigmoid")
    if int(k.get("attention.sliding_window", 0) or 0):
        refuse(g, "attention.sliding_window", k["attention.sliding_window"], "transformers' LFM2-MoE has no window")
    if int(k.get("expert_group_count", 1) or 1) > 1:
        refuse(g, "expert_group_count", k["expert_group_count"], "transformers' LFM2-MoE routes without groups")
    kv = g.per_layer("attention.head_count_kv", n)
    heads = sorted({v for v in kv if v})
    if len(kv) != n or len(heads) != 1:
        refuse(g, "attention.head_count_kv", kv, "not one KV head count on the attention layers (0 on the "
               "convolutions)")
    return text_config(
        g, "lfm2_moe", num_key_value_heads=heads[0], layer_types=["full_attention" if v else "conv" for v in kv],
        norm_eps=float(k["attention.layer_norm_rms_epsilon"]), conv_L_cache=int(k["shortconv.l_cache"]),
        conv_bias=False, num_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
        moe_intermediate_size=int(k["expert_feed_forward_length"]),
        num_dense_layers=int(k.get("leading_dense_block_count", 0)), use_expert_bias=True, norm_topk_prob=True,
        routed_scaling_factor=1.0)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    if (found := moe_values(key, g, "feed_forward.expert_bias")) is not None:
        return found
    i = layer_of(key)
    if i is None or not key.endswith("conv.conv.weight"):
        return None
    taps = g.read(f"blk.{i}.shortconv.conv.weight")  # ([hidden, L] -> [hidden, 1, L])
    return None if taps is None or taps.ndim != 2 else taps[:, None, :]


FAMILIES = (Family("lfm2moe", "lfm2_moe", "LFM2-MoE", _config, values=_values),)
