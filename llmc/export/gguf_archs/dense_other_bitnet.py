"""BitNet b1.58 (llama.cpp's `bitnet`, the converter's `BitnetModel`): `TextModel`'s keys and a linear rotary
scaling of 1 (none), the norms before the output and down products (`attn_sub_norm` / `ffn_sub_norm`), the head
tied to the embeddings (llama.cpp's BitNet has no `output`).

The converter stores each q / k / v / output / gate / up / down product already rounded: w / s rounded to -1, 0 or 1
and times s again, s the mean |w| of the whole matrix (the checkpoint's own weight quantization) — in F32 / F16 /
BF16, or packed by TQ1_0 / TQ2_0 (their blocks' scales are that s), dequantized here as any GGUF tensor. A file
may instead hold the ternary values with the scale as a one-value `<product>.scale` tensor, which llama.cpp
multiplies each product's output by: folded into the weight here (w x s), the same product.

The model read is transformers' BitNet with plain products of those weights: what llama.cpp computes, which
rounds no activations (transformers' published BitNet rounds them to int8 per token: not this file's model).
Its activation is `hidden_activation` where a file has it (relu2 for bitnet-b1.58-2B-4T's), else SiLU (llama.cpp's
default: the 1bitLLM checkpoints the converter takes). Refused: an `output` tensor, a partial rotary."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, text_config

_PRODUCTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
_NORMS = {"self_attn.attn_sub_norm": "attn_sub_norm", "mlp.ffn_sub_norm": "ffn_sub_norm"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "relu2": "relu2", "relu_sqr": "relu2", "relu_squared": "relu2"}


def _config(g: GGUFFile) -> Any:
    k = g.keys
    if "output.weight" in g.tensors:
        raise UnsupportedModelError(f"{g.path}: output.weight: llama.cpp's BitNet computes its head with the "
                                    "embeddings (token_embd.weight)")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    whole_head_rotated(g, head)
    act = str(k.get("hidden_activation", "silu"))
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{g.path}: bitnet.hidden_activation {act!r}: llmc reads BitNet's silu and relu2")
    biases = [f"blk.0.{n}.bias" in g.tensors for n in ("attn_q", "attn_k", "attn_v", "attn_output")]
    if any(biases) and not all(biases):
        raise UnsupportedModelError(f"{g.path}: biases on some of q / k / v / output only: transformers' BitNet "
                                    "has all four or none")
    config = text_config(g, "bitnet", head_dim=head, hidden_act=_ACTIVATIONS[act], attention_bias=all(biases),
                         tie_word_embeddings=True)
    rope = {**config.rope_parameters, "rope_theta": float(k.get("rope.freq_base", 10_000.0))}
    if rope.get("rope_type") == "linear" and float(rope.get("factor", 1.0)) == 1.0:  # (the converter's "none")
        rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    config.rope_parameters = rope
    return config


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    parts = key.split(".")
    if len(parts) < 6 or parts[1] != "layers":
        return None
    blk, module, kind = f"blk.{parts[2]}", ".".join(parts[3:5]), parts[5]
    if module in _NORMS and kind == "weight":  # (transformers' names, not in gguf's table)
        return g.read(f"{blk}.{_NORMS[module]}.weight")
    if module in _PRODUCTS and kind == "weight":
        weight = g.read(f"{blk}.{_PRODUCTS[module]}.weight")
        scale = g.read(f"{blk}.{_PRODUCTS[module]}.scale")
        if weight is None or scale is None:
            return weight
        if scale.size != 1:
            raise UnsupportedModelError(f"{g.path}: {blk}.{_PRODUCTS[module]}.scale has {scale.size} values: "
                                        "llama.cpp's BitNet scales a product by one")
        return weight * np.float32(scale.reshape(-1)[0])
    return None


FAMILIES = (Family("bitnet", "bitnet", "BitNet b1.58", _config, values=_values),)
