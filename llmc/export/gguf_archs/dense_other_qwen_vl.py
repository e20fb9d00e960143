"""The language models of Qwen2-VL / Qwen2.5-VL (llama.cpp's `qwen2vl`, the converter's `Qwen2VLModel`), Qwen3-VL
(`qwen3vl`, `Qwen3VLTextModel` on `Qwen3Model`) and Qwen3-VL-MoE (`qwen3vlmoe`, `Qwen3VLMoeTextModel` on
`Qwen3MoeModel`), the text half of the files people pair with an `mmproj`: their family's keys and tensors as they
are (Qwen2's q / k / v biases, Qwen3's q / k norms, the MoE's experts stacked per projection), plus the multimodal
rotary's sections (`rope.dimension_sections`) and Qwen3-VL's count of DeepStack layers.

On text every section of the multimodal rotary takes the same position (llama.cpp puts a text token's position in
each), and the sections only choose whose position a frequency turns by: the rotation is the family's own rotary,
exactly (the same as llmc's checkpoints of these models: arch.TEXT_FAMILY). DeepStack adds the image features' later
slices of the input embedding after its first layers, zero for text. So each reads as its text family: transformers'
Qwen2, Qwen3, Qwen3-MoE (which always renormalizes the chosen experts' weights here, as llama.cpp's qwen3vlmoe
does).

Refused: sections that do not cover the rotated dims, or that give a 4th (llama.cpp's extra) position any dims:
text would not turn there as one rotary."""

from __future__ import annotations

from typing import Any

from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_archs.moe_common import moe_values
from llmc.export.gguf_read import Family, GGUFFile, text_config, text_sections


def _sections(g: GGUFFile, head: int) -> None:
    """Whole heads rotated, by sections that turn text as one rotary (`text_sections`)."""
    whole_head_rotated(g, head)
    text_sections(g, head)


def _head(g: GGUFFile) -> int:
    k = g.keys
    return int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))


def _qwen2vl(g: GGUFFile) -> Any:
    head = _head(g)
    _sections(g, head)
    return text_config(g, "qwen2")


def _qwen3vl(g: GGUFFile) -> Any:
    head = _head(g)
    _sections(g, head)
    return text_config(g, "qwen3", head_dim=head, attention_bias="blk.0.attn_q.bias" in g.tensors)


def _qwen3vlmoe(g: GGUFFile) -> Any:
    k = g.keys
    head = _head(g)
    _sections(g, head)
    return text_config(g, "qwen3_moe", head_dim=head, attention_bias="blk.0.attn_q.bias" in g.tensors,
                       num_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
                       moe_intermediate_size=int(k["expert_feed_forward_length"]), norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[])


FAMILIES = (Family("qwen2vl", "qwen2", "Qwen2-VL (text)", _qwen2vl),
            Family("qwen3vl", "qwen3", "Qwen3-VL (text)", _qwen3vl),
            Family("qwen3vlmoe", "qwen3_moe", "Qwen3-VL-MoE (text)", _qwen3vlmoe,
                   values=lambda key, g, config: moe_values(key, g)))
