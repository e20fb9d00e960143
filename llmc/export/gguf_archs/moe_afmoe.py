"""Arcee's Trinity (llama.cpp's `afmoe`, the converter's `AfmoeModel` on `LlamaModel`): `LlamaModel`'s keys (the
vocabulary size, the rotated dims: the head size), the experts' count / width / shared count, the leading dense
layers, the routing's renormalization (`route_norm`) and scale (`route_scale`), the window, the gating function
where the checkpoint names one (`TextModel`'s); the weights as they are (its `modify_tensors` skips
`LlamaModel`'s q / k reordering: llama.cpp rotates NeoX's way, as transformers does), each layer's experts stacked
per projection, the selection bias (`expert_bias`) as `exp_probs_b.bias`, the attention's output gate as
`attn_gate`.

llama.cpp's model (src/models/afmoe.cpp) scales the embeddings by sqrt(width) whatever the checkpoint's
`mup_enabled` (so the model is transformers' with it set), norms before and after attention and MLP, q / k RMS
norms, gates the attention's output by sigmoid(attn_gate x) before `attn_output`, routes by sigmoid (none written)
with the selection bias, renormalized where `expert_weights_norm` and scaled by `expert_weights_scale`, a shared
expert beside the routed ones where `expert_shared_count` > 0 and dense layers before `leading_dense_block_count`.
It slides a window on each layer but every 4th (`attention.sliding_window_pattern` a scalar period; an array is
not read) and rotates every layer but every 4th (fixed): transformers' AFMoE rotates exactly its sliding layers, so
the two must coincide. The rotated layers' base is `rope.freq_base_swa` where the file has one.

Refused: softmax routing, no renormalization (transformers' AFMoE always renormalizes), no window (llama.cpp then
slides none but still leaves every 4th layer unrotated), a period other than 4, a rotated share of a head."""

from __future__ import annotations

from typing import Any

from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_archs.moe_common import bias_values, refuse, sigmoid_renormalized
from llmc.export.gguf_archs.moe_exaone import rope_base, swa_period
from llmc.export.gguf_read import Family, GGUFFile, text_config

NO_ROPE_STEP = 4  # (llama.cpp's n_no_rope_layer_step: a literal, no key)


def _config(g: GGUFFile) -> Any:
    k = g.keys
    sigmoid_renormalized(g, "AFMoE")
    window = int(k.get("attention.sliding_window", 0) or 0)
    if window <= 0:
        refuse(g, "attention.sliding_window", window, "without a window llama.cpp slides no layer yet leaves every "
               "4th unrotated; transformers' AFMoE rotates exactly its sliding layers")
    heads, hidden = int(k["attention.head_count"]), int(k["embedding_length"])
    head = int(k.get("attention.key_length") or hidden // heads)
    whole_head_rotated(g, head)
    n = int(k["block_count"])
    sliding = swa_period(g, n)
    if sliding != [(i + 1) % NO_ROPE_STEP != 0 for i in range(n)]:
        refuse(g, "attention.sliding_window_pattern", k["attention.sliding_window_pattern"], "llama.cpp rotates "
               "every layer but each 4th; transformers' AFMoE rotates its sliding layers only")
    width = int(k["expert_feed_forward_length"])
    config = text_config(
        g, "afmoe", head_dim=head, hidden_act="silu", attention_bias=False, mup_enabled=True,
        sliding_window=window, layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        global_attn_every_n_layers=NO_ROPE_STEP, num_dense_layers=int(k.get("leading_dense_block_count", 0) or 0),
        num_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
        moe_intermediate_size=width, num_shared_experts=int(k["expert_shared_count"]),
        route_scale=float(k.get("expert_weights_scale", 1.0) or 1.0))
    config.rope_parameters = {**config.rope_parameters, "rope_theta": rope_base(g)}
    return config


FAMILIES = (Family("afmoe", "afmoe", "Trinity (AFMoE)", _config, values=bias_values("mlp.expert_bias")),)
