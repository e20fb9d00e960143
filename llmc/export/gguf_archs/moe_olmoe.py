"""OLMoE (llama.cpp's `olmoe`, the converter's `OlmoeModel`): `TextModel`'s keys (the experts' width as
`feed_forward_length`, their count and top-k), RMS epsilon 1e-5; q / k as they are (no permute: llama.cpp rotates
OLMoE's halves as transformers does), their norms over the whole q / k width; the experts stacked per projection.
llama.cpp routes by softmax over every expert and never renormalizes the top-k (src/models/olmoe.cpp), as OLMoE's
checkpoints do (norm_topk_prob false): the file says nothing else."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.export.gguf_archs.moe_common import experts
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    return text_config(g, "olmoe", num_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
                       norm_topk_prob=False, attention_bias=False, clip_qkv=None)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    return experts(key, g)


FAMILIES = (Family("olmoe", "olmoe", "OLMoE", _config, values=_values),)
