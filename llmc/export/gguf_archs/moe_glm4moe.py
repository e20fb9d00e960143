"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (llama.cpp's `glm4moe`, the converter's `Glm4MoeModel`): `TextModel`'s keys with
the NextN (multi-token prediction) layers counted in `block_count` and named by `nextn_predict_layers`, the rotated
dims (`rope.dimension_count`: half of each head in every published checkpoint), the experts' count / width / shared
count, the leading dense layers, sigmoid routing with its selection bias (`exp_probs_b`), the weights' scale and
renormalization; q / k rows as they are (llama.cpp rotates GLM-4.5's halves, NeoX's way, as transformers does);
each layer's experts stacked per projection.

llama.cpp loads the NextN layers' tensors and never runs them (src/models/glm4-moe.cpp: `TENSOR_SKIP`, the graph
stops at `block_count - nextn_predict_layers`), as transformers drops `model.layers.{46,92}.*` of the checkpoints:
the model is the layers before them, their tensors are passed over and the config has no MTP layers.

GLM-4.5V's text (`Glm4vMoeForConditionalGeneration` through the same converter) adds the multimodal rotary's
sections, its q / k rows as they are (it turns NeoX's pairs already): on text every section turns by the same
position (`text_sections`), so it is GLM-4.5 (llmc's checkpoints of it are too: arch.TEXT_FAMILY).

Refused: sections that would not turn text as one rotary, and softmax routing (transformers' GLM-4.5 routes by
sigmoid)."""

from __future__ import annotations

from typing import Any

from llmc.export.gguf_archs.moe_common import bias_values, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config, text_sections

SOFTMAX, SIGMOID = 1, 2  # (llama.cpp's expert_gating_func values)


def _config(g: GGUFFile) -> Any:
    k = g.keys
    gating = int(k.get("expert_gating_func", SIGMOID) or SIGMOID)  # (llama.cpp: none written is sigmoid)
    if gating != SIGMOID:
        refuse(g, "expert_gating_func", gating, "transformers' GLM-4.5 routes by sigmoid")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    rotated = int(k.get("rope.dimension_count", head))
    text_sections(g, rotated)  # (GLM-4.5V's text: on text its sections turn as GLM-4.5's rotary)
    groups = int(k.get("expert_group_count", 1) or 1)
    config = text_config(
        g, "glm4_moe", num_hidden_layers=g.layers(), head_dim=head, hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in g.tensors, use_qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        n_routed_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
        moe_intermediate_size=int(k["expert_feed_forward_length"]), n_shared_experts=int(k["expert_shared_count"]),
        first_k_dense_replace=int(k.get("leading_dense_block_count", 0)),
        routed_scaling_factor=float(k.get("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(k.get("expert_weights_norm", False)), n_group=groups,
        topk_group=int(k.get("expert_group_used_count", groups) or groups), num_mtp_layers=0)
    # (GLM-4.5's config puts 0.5 in for a rotary table without a fraction: the file's, whatever it is)
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotated / head}
    return config


FAMILIES = (Family("glm4moe", "glm4_moe", "GLM-4.5", _config, values=bias_values("mlp.gate.e_score_correction_bias")),)
