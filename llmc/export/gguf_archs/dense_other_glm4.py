"""GLM-4-0414 / GLM-Z1 (llama.cpp's `glm4`, the converter's `Glm4Model`): `TextModel`'s keys, the rotated dims as
`rope.dimension_count` (half of each head in every published checkpoint), the fused gate / up product as
`ffn_up` (gate rows first, as llama.cpp's SwiGLU splits it and transformers' `gate_up_proj` chunks it), the two
extra norms after attention and after the MLP; q / k rows as they are (llama.cpp rotates GLM-4's interleaved pairs,
as transformers' GLM-4 does). The q / k / v biases are the file's (GLM-4-9B's have them, 32B's not); the output
product has none.

GLM-4.1V's text (`Glm4vForConditionalGeneration` through the same converter) adds the multimodal rotary's sections
and writes each head's rotated q / k rows even ones first, then odd ones, for llama.cpp's multimodal rotary (NeoX's
pairs only): on text every section turns by the same position (`text_sections`), so with the rows put back it is
GLM-4 (llmc's checkpoints of it are too: arch.TEXT_FAMILY).

Refused: sections that would not turn text as one rotary, and files with NextN layers (`nextn_predict_layers`,
GLM-OCR's: transformers' GLM-4 has no place for them).

GLM-4-9B and ChatGLM3 (llama.cpp's `chatglm`, the converter's `ChatGLMModel` for `GlmForCausalLM` and THUDM's own
`ChatGLMModel` format): the same model without the two extra norms, transformers' `glm`. Its keys are the
converter's own: the context (`seq_length`), the MLP width (`ffn_hidden_size`), the KV heads
(`multi_query_group_num`), the RMS epsilon, the rotated dims (half of each head unless `partial_rotary_factor` says
otherwise) and the rotary base (10,000 x `rope_ratio`: the checkpoint's `rope_theta` is not read, so the file's base
is what llama.cpp computes with); q / k / v as three products (from `GlmForCausalLM`) or as THUDM's one
`query_key_value` (`attn_qkv`: the queries' rows, then the keys', then the values', each with its bias), split here;
the fused gate / up product as `ffn_up`; llama.cpp rotates interleaved pairs, as transformers' GLM does."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.moe_common import layer_of
from llmc.export.gguf_read import Family, GGUFFile, text_config, text_sections


def _config(g: GGUFFile) -> Any:
    k = g.keys
    if int(k.get("nextn_predict_layers", 0)):
        raise UnsupportedModelError(f"{g.path}: glm4.nextn_predict_layers {k['nextn_predict_layers']}: "
                                    "transformers' GLM-4 has no NextN layers")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    rotated = int(k.get("rope.dimension_count", head))
    text_sections(g, rotated)  # (GLM-4.1V's text: its rows put back in `_values`)
    config = text_config(g, "glm4", head_dim=head, hidden_act="silu",
                         attention_bias="blk.0.attn_q.bias" in g.tensors)
    # (GLM-4's config puts 0.5 in for a rotary table without a fraction: the file's, whatever it is)
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotated / head,
                              "rope_theta": float(k.get("rope.freq_base", 10_000.0))}  # (llama.cpp's default)
    return config


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """GLM-4.1V's q / k rows (and biases) put back in their heads' order: its converter writes each head's rotated
    dims even ones first, then odd ones (`normal_to_neox`), for llama.cpp's multimodal rotary, which turns only
    NeoX's pairs; None for the rest, and for every parameter of a file without sections."""
    i, head = layer_of(key), config.head_dim
    rotated = int(g.keys.get("rope.dimension_count", head))
    if i is None or not key.endswith(_QK) or not text_sections(g, rotated):
        return None
    rows = g.read(f"blk.{i}.attn_{'q' if '.q_proj.' in key else 'k'}.{key.rsplit('.', 1)[-1]}")
    if rows is None:
        return None
    heads = rows.reshape(rows.shape[0] // head, head, -1)
    out = heads.copy()
    out[:, 0:rotated:2], out[:, 1:rotated:2] = heads[:, :rotated // 2], heads[:, rotated // 2:rotated]
    return out.reshape(rows.shape)


_QK = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")


def _chatglm_config(g: GGUFFile) -> Any:
    k = g.keys
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    bias = "blk.0.attn_q.bias" in g.tensors or "blk.0.attn_qkv.bias" in g.tensors
    config = text_config(g, "glm", head_dim=head, hidden_act="silu", attention_bias=bias)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": float(k.get("rope.freq_base", 10_000.0)),
                              "partial_rotary_factor": int(k.get("rope.dimension_count", head)) / head}
    return config


_QKV = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}


def _chatglm_values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """A q / k / v product or bias from THUDM's fused `attn_qkv` (the queries' rows, the keys', the values');
    None where the file holds it on its own (or for another parameter)."""
    i = layer_of(key)
    part, _, kind = key.rpartition(".")
    which = _QKV.get(part.split(".", 3)[-1]) if i is not None else None
    fused = f"blk.{i}.attn_qkv.{kind}"
    if which is None or fused not in g.tensors:
        return None
    rows = g.read(fused)
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    if rows is None or rows.shape[0] != q + 2 * kv:
        raise UnsupportedModelError(f"{g.path}: {fused} has {None if rows is None else rows.shape[0]} rows, not the "
                                    f"{q + 2 * kv} of {config.num_attention_heads} query and "
                                    f"{config.num_key_value_heads} KV heads of {config.head_dim}")
    start = (0, q, q + kv)[which]
    return rows[start:start + (q, kv, kv)[which]]


FAMILIES = (Family("glm4", "glm4", "GLM-4", _config, values=_values),
            Family("chatglm", "glm", "GLM-4-9B / ChatGLM", _chatglm_config, values=_chatglm_values))
