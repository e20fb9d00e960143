"""Hy3 (Tencent's HY V3; llama.cpp's `hy_v3`, the converter's `HYV3Model`, a bare `TextModel`): `TextModel`'s keys
with the multi-token-prediction blocks counted in `block_count` (`nextn_predict_layers`), the experts' and the
shared experts' widths, sigmoid gating, the routing's renormalization (`route_norm`) and scale
(`router_scaling_factor`); the weights as they are (llama.cpp rotates NeoX's way, as transformers does), the
selection bias as `exp_probs_b` (the checkpoint's `mlp.e_score_correction_bias`: the converter's name table gives
it no `.bias`), each layer's experts stacked per projection. gguf's package names no `hy_v3` tensors yet: the file
follows GLM-4.5's table (the same q / k / v, q / k norms, dense, routed and shared products).

llama.cpp's model (src/models/hy-v3.cpp) norms q and k per head, routes by the sigmoid with the selection bias,
renormalizes the chosen weights where `expert_weights_norm` (none written: not) and scales them by
`expert_weights_scale` (none: 1), adds the shared experts (no gate), and takes a layer without a router as dense:
transformers' HY V3, which always renormalizes, with its `mlp_layer_types` from the file's routers.

Refused: softmax routing, no renormalization, shared experts not a whole number of experts wide."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_archs.moe_common import layer_of, moe_values, refuse, sigmoid_renormalized
from llmc.export.gguf_read import Family, GGUFFile, text_config

BIAS = "mlp.e_score_correction_bias"


def _config(g: GGUFFile) -> Any:
    k = g.keys
    sigmoid_renormalized(g, "HY V3")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    whole_head_rotated(g, head)
    width = int(k["expert_feed_forward_length"])
    shared = int(k.get("expert_shared_feed_forward_length", width) or width)
    if shared % width:
        refuse(g, "expert_shared_feed_forward_length", shared, f"not a whole number of experts {width} wide")
    n = g.layers()
    return text_config(
        g, "hy_v3", num_hidden_layers=n, head_dim=head, hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in g.tensors, num_experts=int(k["expert_count"]),
        num_experts_per_tok=int(k["expert_used_count"]), moe_intermediate_size=width,
        num_shared_experts=shared // width, router_scaling_factor=float(k.get("expert_weights_scale", 0.0) or 1.0),
        mlp_layer_types=["sparse" if f"blk.{i}.ffn_gate_inp.weight" in g.tensors else "dense" for i in range(n)])


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """The experts, the router, and the selection bias under either of its names; None for the rest."""
    i = layer_of(key)
    if i is not None and key.endswith(BIAS):
        return g.read(next((n for n in (f"blk.{i}.exp_probs_b", f"blk.{i}.exp_probs_b.bias") if n in g.tensors), None))
    return moe_values(key, g)


FAMILIES = (Family("hy_v3", "hy_v3", "Hy3 (HY V3)", _config, values=_values, table="glm4moe"),)
