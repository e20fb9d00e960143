"""MiniCPM3 (llama.cpp's `minicpm3`, the converter's `MiniCPM3Model`): latent attention as DeepSeek-V2's, rotated in
halves (llama.cpp's NeoX rotary, transformers' MiniCPM3 too: the converter reorders nothing). Its own keys only:
the context, widths, head counts, RMS epsilon, vocabulary size, the q / kv latent ranks, the q / k head size
(`attention.key_length` = unrotated + rotated dims) and the rotated dims (`rope.dimension_count`); no rotary base
(llama.cpp's 10,000), no value head size (width / heads), no multipliers: llama.cpp's MiniCPM3 takes the
embeddings x 12, each residual branch x 1.4 / sqrt(layers), the head's input x 256 / width, as MiniCPM3-4B has
them. Its longrope factors are the `rope_factors_long` / `rope_factors_short` tensors with no scaling keys:
llama.cpp rotates by the short ones up to the training context (`rope.scaling.original_context_length`, the
context without it) with no attention factor (`rope.scaling.attn_factor`, 1 without it), as transformers' longrope
does up to its original context.

Refused: a file without `attention.q_lora_rank` (llama.cpp's MiniCPM3 always has the q latent)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_read import Family, GGUFFile, text_config

_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _config(g: GGUFFile) -> Any:
    k = g.keys
    if k.get("attention.q_lora_rank") is None:
        raise UnsupportedModelError(f"{g.path}: a MiniCPM3 GGUF without minicpm3.attention.q_lora_rank: llama.cpp's "
                                    "MiniCPM3 projects queries through a latent")
    width, heads = int(k["embedding_length"]), int(k["attention.head_count"])
    qk_head, rotated = int(k["attention.key_length"]), int(k["rope.dimension_count"])
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 10_000.0))}
    long, short = (g.tensors.get(name) for name in _FACTORS)
    if (long is None) != (short is None):
        raise UnsupportedModelError(f"{g.path}: one of {' / '.join(_FACTORS)} without the other")
    if long is not None and short is not None:
        rope.update(rope_type="longrope", long_factor=[float(x) for x in np.asarray(long.data).ravel()],
                    short_factor=[float(x) for x in np.asarray(short.data).ravel()],
                    original_max_position_embeddings=int(k.get("rope.scaling.original_context_length",
                                                               k["context_length"])),
                    attention_factor=float(k.get("rope.scaling.attn_factor", 1.0)))
    return text_config(g, "minicpm3", hidden_act="silu", attention_bias=False, mlp_bias=False,
                       q_lora_rank=int(k["attention.q_lora_rank"]), kv_lora_rank=int(k["attention.kv_lora_rank"]),
                       qk_rope_head_dim=rotated, qk_nope_head_dim=qk_head - rotated,
                       v_head_dim=int(k.get("attention.value_length", width // heads)),
                       scale_emb=12.0, scale_depth=1.4, dim_model_base=256, rope_parameters=rope)


FAMILIES = (Family("minicpm3", "minicpm3", "MiniCPM3", _config),)
