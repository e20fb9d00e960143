"""Llama 4's language model (llama.cpp's `llama4`, the converter's `Llama4Model` on `LlamaModel`): `LlamaModel`'s
keys (the vocabulary size, the rotated dims: the head size), `feed_forward_length` the dense layers' width
(transformers' `intermediate_size_mlp`: the converter swaps the two names back), `expert_feed_forward_length` the
experts' and the shared expert's (transformers' `intermediate_size`), `interleave_moe_layer_step`; the weights as
they are (its `undo_permute` is off: llama.cpp rotates pairs of neighbours, as transformers' complex product does),
each layer's experts split from transformers' `gate_up_proj` [E, H, 2I] and stacked per projection, transposed to
gguf's [E, I, H] (down [E, H, I]); a Llama 3 rotary scaling as `rope_freqs` divisors (`LlamaModel`'s).

llama.cpp's model (src/models/llama4.cpp) reads no chunk size, temperature or qk-norm switch from the file: it
attends in chunks of 8,192 on every layer but each 4th, rotates exactly those layers (`n_no_rope_layer_step`, a
literal 4), RMS-normalizes their q and k without weights unless the model has 128 experts (Maverick), scales the
queries of the unrotated layers by `1 + 0.1 log1p(floor((p + 1) / 8192))`, routes by the sigmoid of the top
experts' logits applied to the experts' inputs, adds a shared expert, and puts a mixture on each layer ending an
`interleave_moe_layer_step`: transformers' Llama 4 with its Scout / Maverick defaults. The rotated layers' base is
`rope.freq_base_swa` where the file has one.

Refused: a window of 0 (llama.cpp then chunks nothing but leaves its last layer unrotated, which no checkpoint
does), a chunking period other than 4 (its chunked layers would not be its rotated ones), a query scale other than
the head size's, a rotated share of a head, no mixture step."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_archs.moe_common import experts, refuse
from llmc.export.gguf_archs.moe_exaone import rope_base, swa_period
from llmc.export.gguf_read import Family, GGUFFile, text_config

NO_ROPE_STEP = 4  # (llama.cpp's n_no_rope_layer_step: a literal, no key)
CHUNK = 8192  # (llama.cpp's n_swa for Llama 4, whatever the file says; also its temperature's floor scale)
MAVERICK_EXPERTS = 128  # (llama.cpp drops the q / k norms for the model type of 128 experts)


def _config(g: GGUFFile) -> Any:
    k = g.keys
    window = k.get("attention.sliding_window")
    if window is not None and int(window) == 0:
        refuse(g, "attention.sliding_window", window, "llama.cpp then chunks no layer yet leaves its last one "
               "unrotated; transformers' Llama 4 rotates its chunked layers")
    heads, hidden = int(k["attention.head_count"]), int(k["embedding_length"])
    head = int(k.get("attention.key_length") or hidden // heads)
    whole_head_rotated(g, head)
    scale = float(k.get("attention.scale", 0.0) or 0.0)
    if scale and not math.isclose(scale, head ** -0.5, rel_tol=1e-6):
        refuse(g, "attention.scale", scale, f"transformers' Llama 4 scales the queries by {head} ** -0.5")
    step = int(k["interleave_moe_layer_step"])
    if step <= 0:
        refuse(g, "interleave_moe_layer_step", step, "llama.cpp's Llama 4 has a mixture on some layers")
    n = g.layers()
    rotated = [(i + 1) % NO_ROPE_STEP != 0 for i in range(n)]
    if swa_period(g, n) != rotated:
        refuse(g, "attention.sliding_window_pattern", k["attention.sliding_window_pattern"], "llama.cpp rotates "
               "every layer but each 4th; transformers' Llama 4 chunks exactly its rotated layers")
    count = int(k["expert_count"])
    config = text_config(
        g, "llama4_text", head_dim=head, hidden_act="silu", attention_bias=False,
        intermediate_size=int(k["expert_feed_forward_length"]), intermediate_size_mlp=int(k["feed_forward_length"]),
        num_local_experts=count, num_experts_per_tok=int(k["expert_used_count"]), interleave_moe_layer_step=step,
        moe_layers=list(range(step - 1, n, step)), no_rope_layers=[int(r) for r in rotated],
        no_rope_layer_interval=NO_ROPE_STEP, attention_chunk_size=CHUNK,
        layer_types=["chunked_attention" if r else "full_attention" for r in rotated],
        use_qk_norm=count != MAVERICK_EXPERTS, attn_temperature_tuning=True, floor_scale=CHUNK, attn_scale=0.1)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": rope_base(g)}
    return config


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """The experts in transformers' Llama 4 layout ([E, H, 2I] gate and up, [E, I, H] down); None for the rest."""
    if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return None
    stacked = experts(key, g)
    return None if stacked is None else np.ascontiguousarray(stacked.transpose(0, 2, 1))


FAMILIES = (Family("llama4", "llama4_text", "Llama 4", _config, values=_values),)
