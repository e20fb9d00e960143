"""K-EXAONE (llama.cpp's `exaone-moe`, the converter's `ExaoneMoEModel` on `Exaone4Model`): `TextModel`'s keys with
the MTP layers counted in `block_count` and named by `nextn_predict_layers`, the vocabulary size, the window
(`attention.sliding_window`, which llama.cpp requires) and the checkpoint's layer types as a per-layer
`attention.sliding_window_pattern`, the experts' width / shared count / shared width (the width x the count), the
weights' scale and renormalization, the leading dense layers, the gating function (`TextModel`'s, from the
checkpoint's `scoring_func`: sigmoid); the weights as they are (no q / k reordering: llama.cpp rotates NeoX's way,
as transformers does), each layer's experts stacked per projection, the routing's selection bias as
`exp_probs_b.bias`.

llama.cpp's model (src/models/exaone-moe.cpp) is a pre-norm block with q / k RMS norms, rotating only its sliding
layers (transformers' with a window: "global NoPE"), sigmoid routing with the selection bias, renormalized where
`expert_weights_norm` and scaled by `expert_weights_scale`, a shared expert beside the routed ones and dense
layers before `leading_dense_block_count`. Its sliding layers are a period (4 unless a scalar
`attention.sliding_window_pattern` says otherwise: the converter's per-layer array is not read as a period), each
period's last layer attending fully; it reads no expert groups (`expert_group_count`), so none are taken here.
The rotary base of the sliding layers (the only ones rotated) is `rope.freq_base_swa` where the file has one.
The MTP layers are left out (llama.cpp skips them; transformers' model has none).

Refused: another gating function than sigmoid, a rotated share of a head (llama.cpp asserts whole heads), a
per-layer pattern that is not the period llama.cpp runs, a shared width that is not a whole number of experts."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_archs.moe_common import layer_of, moe_values, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config

SIGMOID = 2  # (llama.cpp's expert_gating_func value)


def swa_period(g: GGUFFile, n: int, default: int = 4) -> list[bool]:
    """Which of `n` layers slide, as llama.cpp's `set_swa_pattern(period)` marks them: the period is
    `attention.sliding_window_pattern` where it is a scalar, `default` where the file has none or an array (llama.cpp
    reads a scalar here and passes over an array); a layer slides unless it ends its period. An array that is not
    that pattern is refused: llama.cpp would not run the layers it names."""
    key = "attention.sliding_window_pattern"
    value = g.keys.get(key)
    period = int(value) if value is not None and not isinstance(value, list) else default
    sliding = [period == 0 or (i % period) < period - 1 for i in range(n)]
    if isinstance(value, list) and [bool(v) for v in value[:n]] != sliding:
        refuse(g, key, value, f"llama.cpp slides every layer but each {period}th, whatever the array says")
    return sliding


def rope_base(g: GGUFFile) -> float:
    """The sliding layers' rotary base (llama.cpp's `rope_freq_base_train_swa`: `rope.freq_base_swa`, else the
    file's base, else 10,000)."""
    k = g.keys
    return float(k.get("rope.freq_base_swa", k.get("rope.freq_base", 10_000.0)))


def _config(g: GGUFFile) -> Any:
    k = g.keys
    gating = int(k["expert_gating_func"])  # (llama.cpp requires it)
    if gating != SIGMOID:
        refuse(g, "expert_gating_func", gating, "transformers' EXAONE MoE routes by sigmoid")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    whole_head_rotated(g, head)
    n = g.layers()
    width = int(k["expert_feed_forward_length"])
    shared = int(k.get("expert_shared_feed_forward_length", width) or width)
    if shared % width:
        refuse(g, "expert_shared_feed_forward_length", shared, f"not a whole number of experts {width} wide")
    dense = int(k.get("leading_dense_block_count", 0) or 0)
    types = ["sliding_attention" if s else "full_attention" for s in swa_period(g, n)]
    config = text_config(
        g, "exaone_moe", num_hidden_layers=n, head_dim=head, hidden_act="silu",
        sliding_window=int(k["attention.sliding_window"]), layer_types=types,
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(n)], first_k_dense_replace=dense,
        num_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
        moe_intermediate_size=width, num_shared_experts=shared // width,
        norm_topk_prob=bool(k.get("expert_weights_norm", False)),
        routed_scaling_factor=float(k.get("expert_weights_scale", 1.0) or 1.0), n_group=1, topk_group=1)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": rope_base(g)}
    return config


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    found = moe_values(key, g, "mlp.gate.e_score_correction_bias")
    if found is None and layer_of(key) is not None and key.endswith("mlp.gate.e_score_correction_bias"):
        return np.zeros(int(config.num_experts), dtype=np.float32)  # (optional in llama.cpp: none is no bias)
    return found


FAMILIES = (Family("exaone-moe", "exaone_moe", "K-EXAONE", _config, values=_values),)
