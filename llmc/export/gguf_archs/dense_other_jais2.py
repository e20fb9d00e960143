"""Jais-2 (llama.cpp's `jais2`, the converter's `Jais2Model`): `TextModel`'s keys (the LayerNorm epsilon as
`attention.layer_norm_epsilon`) and the rotated dims (the head size); the weights as they are (no q / k reordering:
llama.cpp rotates NeoX's way, as transformers does).

llama.cpp's model (src/models/jais2.cpp) is a pre-norm block of LayerNorms with biases, q / k / v / output with
biases, the whole head rotated, an MLP of up -> ReLU squared -> down with biases, a final LayerNorm; the head is
`output` where the file has one, the embeddings otherwise. It loads the k / v biases one width wide, so every file
it reads has as many KV heads as heads.

Refused: a rotated share of a head (llama.cpp asserts whole heads), grouped KV heads (llama.cpp loads no such
file)."""

from __future__ import annotations

from typing import Any

from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_archs.moe_common import refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    heads, hidden = int(k["attention.head_count"]), int(k["embedding_length"])
    head = int(k.get("attention.key_length") or hidden // heads)
    whole_head_rotated(g, head)
    kv = int(k.get("attention.head_count_kv", heads))
    if kv != heads or head * heads != hidden:
        refuse(g, "attention.head_count_kv", kv, f"llama.cpp's Jais-2 loads k / v biases {hidden} wide: as many KV "
               f"heads as the {heads} heads of {hidden} / {heads}")
    config = text_config(g, "jais2", head_dim=head, hidden_act="relu2", attention_bias=True, mlp_bias=True,
                         layer_norm_eps=float(k["attention.layer_norm_epsilon"]))
    config.rope_parameters = {**config.rope_parameters, "rope_theta": float(k.get("rope.freq_base", 10_000.0))}
    return config


FAMILIES = (Family("jais2", "jais2", "Jais-2", _config),)
