"""GLM-4-0414 / GLM-Z1 (llama.cpp's `glm4`, the converter's `Glm4Model`): `TextModel`'s keys, the rotated dims as
`rope.dimension_count` (half of each head in every published checkpoint), the fused gate / up product as
`ffn_up` (gate rows first, as llama.cpp's SwiGLU splits it and transformers' `gate_up_proj` chunks it), the two
extra norms after attention and after the MLP; q / k rows as they are (llama.cpp rotates GLM-4's interleaved pairs,
as transformers' GLM-4 does). The q / k / v biases are the file's (GLM-4-9B's have them, 32B's not); the output
product has none.

Refused: GLM-4V's text (`rope.dimension_sections`: M-RoPE, its q / k rows reordered for it) and files with
NextN layers (`nextn_predict_layers`, GLM-OCR's: transformers' GLM-4 has no place for them)."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    if any(int(s) for s in (k.get("rope.dimension_sections") or [])):
        raise UnsupportedModelError(f"{g.path}: glm4.rope.dimension_sections {k['rope.dimension_sections']}: "
                                    "GLM-4V's M-RoPE text model, which transformers' GLM-4 does not rotate")
    if int(k.get("nextn_predict_layers", 0)):
        raise UnsupportedModelError(f"{g.path}: glm4.nextn_predict_layers {k['nextn_predict_layers']}: "
                                    "transformers' GLM-4 has no NextN layers")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    rotated = int(k.get("rope.dimension_count", head))
    config = text_config(g, "glm4", head_dim=head, hidden_act="silu",
                         attention_bias="blk.0.attn_q.bias" in g.tensors)
    # (GLM-4's config puts 0.5 in for a rotary table without a fraction: the file's, whatever it is)
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotated / head,
                              "rope_theta": float(k.get("rope.freq_base", 10_000.0))}  # (llama.cpp's default)
    return config


FAMILIES = (Family("glm4", "glm4", "GLM-4", _config),)
