"""Hunyuan-A13B (llama.cpp's `hunyuan-moe`, the converter's `HunYuanMoEModel`): `TextModel`'s keys, the experts'
count, width and top-k (the checkpoint's per-layer lists, one value each), the shared MLP's width and count;
NTK-alpha rotary ("dynamic" with a fixed alpha) folded into the rotary base (base x alpha^(d / (d - 2))) with no
scaling type and a 256k context; q / k as they are (llama.cpp rotates Hunyuan's halves, NeoX's way, as
transformers does), their per-head norms after the rotary; each layer's experts stacked per projection, the shared
MLP as the shared expert.

llama.cpp routes by softmax over every expert, renormalizes the top-k, adds the shared MLP (src/models/
hunyuan-moe.cpp), and builds the routed experts as wide as the dense MLP (`feed_forward_length`), as transformers'
Hunyuan MoE does (its experts and shared MLP are all `intermediate_size` wide). The rotary base is the file's,
with transformers' plain rotary: the frequencies of NTK-alpha's stretched base.

Refused: experts or a shared MLP of another width than `feed_forward_length`, more than one shared MLP, a weights'
scale, grouped routing (transformers' Hunyuan has none of them)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.export.gguf_archs.moe_common import experts, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    width = int(k["feed_forward_length"])
    for key in ("expert_feed_forward_length", "expert_shared_feed_forward_length"):
        if int(k.get(key, width) or width) != width:
            refuse(g, key, k[key], f"transformers' Hunyuan MoE has its experts and shared MLP feed_forward_length "
                   f"{width} wide")
    if int(k.get("expert_shared_count", 1)) != 1:
        refuse(g, "expert_shared_count", k["expert_shared_count"], "transformers' Hunyuan MoE has one shared MLP")
    if float(k.get("expert_weights_scale", 0.0) or 1.0) != 1.0:
        refuse(g, "expert_weights_scale", k["expert_weights_scale"], "transformers' Hunyuan MoE does not scale its "
               "experts' weights")
    if int(k.get("expert_group_count", 1) or 1) > 1:
        refuse(g, "expert_group_count", k["expert_group_count"], "transformers' Hunyuan MoE routes without groups")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    return text_config(g, "hunyuan_v1_moe", head_dim=head, hidden_act="silu",
                       attention_bias="blk.0.attn_q.bias" in g.tensors, num_experts=int(k["expert_count"]),
                       moe_topk=int(k["expert_used_count"]))


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    return experts(key, g)


FAMILIES = (Family("hunyuan-moe", "hunyuan_v1_moe", "Hunyuan MoE", _config, values=_values),)
