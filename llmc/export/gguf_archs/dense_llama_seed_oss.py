"""Seed-OSS (llama.cpp's `seed_oss`, the converter's `SeedOssModel`, a bare `TextModel`: every key the base's, no
tensor reordered, llama.cpp rotating Seed-OSS's halves as transformers does): the head size from
`attention.key_length` (128 beside a width of 5,120 / 80 heads; width / heads without it, as llama.cpp takes it,
not the class's default 128), q / k / v biases where the file has them
(attention_bias: the checkpoints'), the output projection's bias where it has one (attention_out_bias), the norm
before the MLP under gguf's `post_attention_norm`; no MLP biases (llama.cpp's Seed-OSS has none)."""

from __future__ import annotations

from typing import Any

from llmc.export.gguf_archs.dense_llama_common import bias_flag, kv_heads, whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _seed_oss(g: GGUFFile) -> Any:
    k = g.keys
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    whole_head_rotated(g, head)
    return text_config(g, "seed_oss", head_dim=head, num_key_value_heads=kv_heads(g),
                       attention_bias=bias_flag(g, ("attn_q", "attn_k", "attn_v"), "attention_bias"),
                       attention_out_bias="blk.0.attn_output.bias" in g.tensors, mlp_bias=False)


FAMILIES = (Family("seed_oss", "seed_oss", "Seed-OSS", _seed_oss),)
