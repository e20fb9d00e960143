"""FlexOlmo (AllenAI's BAR family; llama.cpp's `flex_olmo`, the converter's `FlexOlmoModel`, an `OlmoeModel`):
`TextModel`'s keys (the experts' width as `feed_forward_length`: the checkpoint's `intermediate_size`, their count and
top-k, the rotary base and scaling) with the RMS epsilon overwritten to 1e-5 whatever the checkpoint's (FlexOlmo's
is 1e-6: llama.cpp norms with the file's); q / k as they are (no permute: llama.cpp rotates FlexOlmo's halves as
transformers does), their norms over the whole q / k width; no norm before attention or the experts, one after each
(`post_attention_norm`, `post_ffw_norm`), as OLMo 2's; the router as `ffn_gate_inp`, each layer's experts stacked per
projection. gguf's package names no `flex_olmo` tensors yet: the file follows OLMo 2's name table, the router and
the experts read here from their stacks.

llama.cpp's model (src/models/flex-olmo.cpp) routes by the softmax over every expert and never renormalizes or
scales the chosen weights (it reads no `expert_gating_func`, `expert_weights_norm` or `expert_weights_scale` for
FlexOlmo), so a checkpoint's `norm_topk_prob` is not in the file and reads as false, as llama.cpp computes it; it
slides no window, has no biases, requires its own head (`output.weight`) and heads of width / heads, wholly rotated
(a rotated share is refused with the rotary table: `gguf_read.apply_rope_freqs`).

Refused: a head size other than width / heads (`attention.key_length` / `value_length`: llama.cpp sizes q, k and v
so), routing keys saying otherwise than llama.cpp computes (gating other than softmax, renormalized or scaled
weights), a file without `output.weight` (llama.cpp loads no tied head for FlexOlmo), a `rope_freqs` tensor
(llama.cpp's FlexOlmo has no place for it)."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.moe_common import experts, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config

# the routing keys' values that say what llama.cpp's FlexOlmo computes whatever they say (it reads none of them):
# softmax gating (or none), weights not renormalized, not scaled
_ROUTING = {"expert_gating_func": (0, 1), "expert_weights_norm": (False,), "expert_weights_scale": (0.0, 1.0)}


def _config(g: GGUFFile) -> Any:
    k = g.keys
    head = int(k["embedding_length"]) // int(k["attention.head_count"])
    for key in ("attention.key_length", "attention.value_length"):
        if int(k.get(key, head)) != head:
            refuse(g, key, k[key], f"llama.cpp's FlexOlmo has heads of width / heads ({head})")
    for key, computed in _ROUTING.items():
        if key in k and k[key] not in computed:
            refuse(g, key, k[key], "llama.cpp's FlexOlmo does not read it: it routes by the softmax over every "
                   "expert, the chosen weights neither renormalized nor scaled")
    if "output.weight" not in g.tensors:
        raise UnsupportedModelError(f"{g.path}: no output.weight: llama.cpp's FlexOlmo requires its own head (it "
                                    "ties none to the embeddings)")
    if "rope_freqs.weight" in g.tensors:
        raise UnsupportedModelError(f"{g.path}: rope_freqs.weight: llama.cpp's FlexOlmo has no place for it")
    return text_config(g, "flex_olmo", num_experts=int(k["expert_count"]),
                       num_experts_per_tok=int(k["expert_used_count"]), norm_topk_prob=False, hidden_act="silu",
                       attention_bias=False)


FAMILIES = (Family("flex_olmo", "flex_olmo", "FlexOlmo", _config, values=lambda key, g, config: experts(key, g),
                   table="olmo2"),)
