"""OLMo 1 (llama.cpp's `olmo`, the converter's `OlmoModel`): `TextModel`'s keys, the LayerNorm epsilon (1e-5,
written as a constant: OLMo's norms have no weights) and the q / k / v clamp (`attention.clamp_kqv`, OLMo 1.7's
clip_qkv); the q / k rows reordered as Llama's (`LlamaModel.permute`); SwiGLU as every checkpoint has it."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, text_config, unpermute


def _config(g: GGUFFile) -> Any:
    k = g.keys
    head = int(k["embedding_length"]) // int(k["attention.head_count"])
    whole_head_rotated(g, head)
    eps = float(k.get("attention.layer_norm_epsilon", 1e-5))
    if abs(eps - 1e-5) > 1e-12:  # (transformers' OLMo norms with 1e-5, fixed)
        raise UnsupportedModelError(f"{g.path}: olmo.attention.layer_norm_epsilon {eps}: transformers' OLMo norms "
                                    "with 1e-5")
    if "rope_freqs.weight" in g.tensors:
        raise UnsupportedModelError(f"{g.path}: rope_freqs.weight: llama.cpp's OLMo has no rotary factors")
    clamp = float(k.get("attention.clamp_kqv", 0.0))  # (llama.cpp clamps where it is above 0)
    return text_config(g, "olmo", clip_qkv=clamp if clamp > 0 else None, hidden_act="silu",
                       attention_bias=False)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """q / k rows back from the converter's reordering for llama.cpp's rotary."""
    if key.endswith("self_attn.q_proj.weight"):
        heads = int(config.num_attention_heads)
    elif key.endswith("self_attn.k_proj.weight"):
        heads = int(config.num_key_value_heads)
    else:
        return None
    rows = g.named(key)
    return None if rows is None else unpermute(rows, heads)


FAMILIES = (Family("olmo", "olmo", "OLMo", _config, values=_values, rope_freqs=False),)
