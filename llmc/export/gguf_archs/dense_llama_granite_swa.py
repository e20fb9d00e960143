"""Granite SWA (IBM's `GraniteSWAForCausalLM`; llama.cpp's `granite_swa`, src/models/granite-swa.cpp). Its converter
class (llama.cpp PR #25505, in `conversion/granite.py`) is not among the sources read here: the file is taken as
Granite's converter (`GraniteModel`, a `LlamaModel`) writes it, with the keys and tensors llama.cpp's loader
requires of this architecture (the sinks' `.weight` name as gpt-oss's converter writes its sinks). Granite's keys (`TextModel`'s without a head size, which the converter pops:
heads are width / heads; the vocabulary size and the head size as the rotated dims; the four multipliers as
`attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale`, each written where the checkpoint's is not 0),
the window (`attention.sliding_window`) and which layers slide (`attention.sliding_window_pattern`, one boolean a
layer), which layers rotate (`attention.rope_pattern`, one boolean a layer: the checkpoint's `layer_rope_theta` 0 is a
layer without positions); q / k rows reordered for llama.cpp's rotary (`LlamaModel.permute`: undone here), each
layer's sinks as `attn_sinks.weight` ([heads]). gguf's package (0.19) names no `granite_swa` tensors: the file
follows Granite's name table, the sinks read here.

llama.cpp's model (src/models/granite-swa.cpp) scales the embeddings, norms (RMS) before attention and MLP, rotates
(normal, consecutive pairs) the layers `rope_pattern` marks (every layer where the file has none) by one base, the
file's `rope.freq_base`, scales the queries by `attention.scale` (1 / sqrt(head size) where none), masks a sliding
layer's keys `sliding_window` back or more (the current token counts), adds each head's sink as one more logit to its
softmax, scales the attention and MLP outputs by `residual_scale` before each residual add, and divides the logits by
`logit_scale`: transformers' GraniteSWA, its `layer_rope_theta` put back as the file's base on the rotated layers and
0 on the others, its `layer_types` from the sliding pattern.

Refused: experts (`expert_count`: GraniteMoeSWA's files, also `granite_swa`, which transformers' dense GraniteSWA
cannot hold), vision features injected at layers (`deepstack_mapping`: Granite 4 Vision's), a head size other than
width / heads (`attention.key_length`) or a rotated share of a head (`rope.dimension_count`: llama.cpp asserts the
whole head), per-layer KV head counts that differ, and a `rope_freqs` tensor (llama.cpp divides the frequencies by
it; transformers' GraniteSWA builds one rotary per base, which llmc does not divide)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import unpermuted_qk
from llmc.export.gguf_archs.dense_llama_granite import granite_values
from llmc.export.gguf_archs.moe_common import layer_of, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config

ARCH = "granite_swa"


def _config(g: GGUFFile) -> Any:
    k = g.keys
    if int(k.get("expert_count", 0) or 0):
        refuse(g, "expert_count", k["expert_count"], "a GraniteMoeSWA file: transformers' GraniteSWA has no experts")
    injected = [i for i, v in enumerate(k.get("deepstack_mapping") or []) if int(v) >= 0]
    if injected:
        refuse(g, "deepstack_mapping", k["deepstack_mapping"], f"vision features added at layers {injected}: "
               "transformers' GraniteSWA takes text alone")
    values = granite_values(g, "GraniteSWA")
    if "rope_freqs.weight" in g.tensors:
        raise UnsupportedModelError(f"{g.path}: rope_freqs.weight: llama.cpp divides the rotary frequencies by it, "
                                    "transformers' GraniteSWA rotates by its bases alone")
    n = g.layers()
    sliding = g.per_layer("attention.sliding_window_pattern", n)
    rotated = g.per_layer("attention.rope_pattern", n, default=1)  # (llama.cpp rotates every layer where none)
    base = float(k.get("rope.freq_base", 10_000.0))
    return text_config(
        g, "granite_swa", **values, sliding_window=int(k["attention.sliding_window"]),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        layer_rope_theta=[base if r else 0.0 for r in rotated])


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """A layer's sinks (`attn_sinks.weight`, in no name table of gguf's package), q / k rows put back in order."""
    if key.endswith("self_attn.sinks"):
        return g.read(f"blk.{layer_of(key)}.attn_sinks.weight")
    return unpermuted_qk(key, g, config)


FAMILIES = (Family(ARCH, "granite_swa", "Granite SWA", _config, values=_values, rope_freqs=False, table="granite"),)
