"""Command A MoE (Cohere 2 MoE; llama.cpp's `cohere2moe`, the converter's `Cohere2MoeModel`): `TextModel`'s keys (the
experts' width as `feed_forward_length` too: the checkpoint's `intermediate_size`), the logit scale, the window and
the layer pattern as an array of booleans, the vocabulary size, the experts' width, the leading dense layers, the
routing's renormalization (`norm_topk_prob`), sigmoid gating (the converter writes it whatever the checkpoint's
`expert_selection_fn`), the shared experts' count and width (their `average` combination: any other is refused by the
converter), the MTP blocks in `block_count`; the weights as they are (llama.cpp turns Cohere's interleaved pairs, as
transformers does), each layer's experts stacked per projection, zero biases dropped. gguf's package names no
`cohere2moe` tensors yet: the file follows GLM-4.5's name table.

llama.cpp's model (src/models/cohere2moe.cpp) norms once before attention and MLP side by side (RMS where the file has
`layer_norm_rms_epsilon`, else a LayerNorm without bias), rotates the sliding layers and the leading dense ones,
routes by the gating function over the experts' logits (renormalized where `expert_weights_norm`, scaled by
`expert_weights_scale`: none written), averages the routed and shared experts' outputs, and scales the logits:
transformers' Cohere 2 MoE with `prefix_dense_sliding_window_pattern` 1, its dense layers `feed_forward_length` wide.

Refused: softmax gating without renormalization (transformers' softmax takes the top experts' logits alone, which is
that renormalized), a scale on the routing weights, a sliding layers' rotary base of its own, a rotated share of a
head."""

from __future__ import annotations

from typing import Any

from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_archs.moe_common import moe_values, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config

SOFTMAX, SIGMOID = 1, 2  # (llama.cpp's expert_gating_func values; none written is sigmoid here)


def _config(g: GGUFFile) -> Any:
    k = g.keys
    gating = int(k.get("expert_gating_func", SIGMOID) or SIGMOID)
    norm = bool(k.get("expert_weights_norm", False))
    if gating not in (SOFTMAX, SIGMOID) or (gating == SOFTMAX and not norm):
        refuse(g, "expert_gating_func", gating, "transformers' Cohere 2 MoE takes the sigmoid of the top experts' "
               "logits, or their softmax (llama.cpp's softmax renormalized)")
    if float(k.get("expert_weights_scale", 0.0) or 0.0) not in (0.0, 1.0):
        refuse(g, "expert_weights_scale", k["expert_weights_scale"], "transformers' Cohere 2 MoE does not scale "
               "the routing weights")
    if "rope.freq_base_swa" in k and float(k["rope.freq_base_swa"]) != float(k.get("rope.freq_base", 10_000.0)):
        refuse(g, "rope.freq_base_swa", k["rope.freq_base_swa"], "transformers' Cohere 2 MoE has one rotary base")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    whole_head_rotated(g, head)
    n, dense = g.layers(), int(k.get("leading_dense_block_count", 0) or 0)
    pattern = k["attention.sliding_window_pattern"]
    sliding = ([bool(s) for s in pattern[:n]] if isinstance(pattern, list) else
               [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n)])
    width = int(k["expert_feed_forward_length"])
    shared = int(k.get("expert_shared_count", 0) or 0)
    if shared and int(k.get("expert_shared_feed_forward_length", width * shared)) != width * shared:
        refuse(g, "expert_shared_feed_forward_length", k["expert_shared_feed_forward_length"], f"not {shared} "
               f"experts {width} wide")
    return text_config(
        g, "cohere2_moe", num_hidden_layers=n, head_dim=head, hidden_act="silu", attention_bias=False,
        logit_scale=float(k.get("logit_scale", 1.0)), sliding_window=int(k["attention.sliding_window"]),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(n)], intermediate_size=width,
        prefix_dense_intermediate_size=int(k["feed_forward_length"]), prefix_dense_sliding_window_pattern=1,
        num_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
        expert_selection_fn="softmax" if gating == SOFTMAX else "sigmoid", norm_topk_prob=norm,
        num_shared_experts=shared, shared_expert_combination_strategy="average")


FAMILIES = (Family("cohere2moe", "cohere2_moe", "Command A MoE (Cohere 2 MoE)", _config,
                   values=lambda key, g, config: moe_values(key, g), table="glm4moe"),)
