"""JetBrains Mellum (Mellum2; llama.cpp's `mellum`, the converter's `MellumModel`, a bare `TextModel`): `TextModel`'s
keys (the head size as `attention.key_length` / `value_length`, the experts' count and top-k), the full layers'
rotary as `rope.freq_base` and `rope.scaling.*` (yarn: factor, original context, betas and the checkpoint's
attention factor as `yarn_attn_factor`), the sliding layers' base as `rope.freq_base_swa`, the experts' width, the
window and the checkpoint's layer types as a per-layer `attention.sliding_window_pattern` of booleans (neither where
the checkpoint has no window); the weights as they are (llama.cpp rotates NeoX's way, as transformers does), each
layer's experts stacked per projection. gguf's package names no `mellum` tensors yet: the file follows Qwen3-MoE's
name table (the same q / k / v, per-head q / k norms, router and experts).

llama.cpp's model (src/models/mellum.cpp) norms q and k per head, routes every layer (a layer without a router is not
loaded) by the softmax over all experts, the chosen ones' weights always renormalized and never scaled (it reads
neither `expert_gating_func`, `expert_weights_norm` nor `expert_weights_scale`), and slides a window where
`attention.sliding_window` is positive, on the layers the pattern names: an array's flags, or a period where the key
is a scalar (each period's last layer full); without the key no layer slides (its period of 4 is read only from a
scalar). It rotates the full layers with the file's scaling and the sliding ones with none, both at
`rope.freq_base`; its yarn is the factor and original context with betas 32 / 1 and a magnitude of 0.1 ln(factor)
+ 1 (times `rope.scaling.attn_factor`): none of the `rope.scaling.yarn_*` keys is read. That is transformers'
Mellum with `norm_topk_prob`, every layer sparse, the sliding layers' rotary plain at the same base, the full
layers' yarn at its own magnitude (transformers' default attention factor).

Refused, where llama.cpp and transformers' Mellum would compute different models from what the file says: a sliding
base of its own (`rope.freq_base_swa`: transformers' Mellum rotates the sliding layers with it, llama.cpp's graph
with `rope.freq_base`), yarn keys llama.cpp does not read set to other than what it takes (the attention factor, the
betas, the extrapolation factor, the log multiplier), `rope.scaling.attn_factor` (a second factor on the full
layers' rotary), a scaling other than none, linear and yarn, a rotated share of a head or values narrower than keys
(llama.cpp asserts whole heads of one size), a layer without a router."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_archs.moe_common import moe_values, refuse
from llmc.export.gguf_archs.moe_exaone import swa_period
from llmc.export.gguf_read import Family, GGUFFile, _scaled_rope, text_config, unread_yarn

PATTERN = "attention.sliding_window_pattern"


def _sliding(g: GGUFFile, n: int) -> list[bool]:
    """Which of `n` layers slide, as llama.cpp's Mellum reads them: none without a positive window or without the
    pattern key, the array's flags (the converter's), or a period where the key is a scalar (`swa_period`)."""
    value = g.keys.get(PATTERN)
    if int(g.keys.get("attention.sliding_window", 0) or 0) <= 0 or value is None:
        return [False] * n
    if isinstance(value, list):
        return [bool(v) for v in g.per_layer(PATTERN, n)]
    return swa_period(g, n)


def _rope(g: GGUFFile) -> dict[str, Any]:
    """The full and sliding layers' rotary parameters: both at `rope.freq_base`, the full layers with the file's
    scaling (`_scaled_rope`, once the yarn keys llama.cpp's Mellum does not read are checked to be what it takes)."""
    k = g.keys
    theta = float(k.get("rope.freq_base", 10_000.0))  # (llama.cpp's default where the file has none)
    if float(k.get("rope.freq_base_swa", theta)) != theta:
        refuse(g, "rope.freq_base_swa", k["rope.freq_base_swa"], f"llama.cpp's Mellum rotates its sliding layers "
               f"with rope.freq_base ({theta}) and only shifts their cache with this one; transformers' Mellum "
               "would rotate them with it")
    keys = unread_yarn(g, "Mellum")
    full = {"rope_type": "default", "rope_theta": theta, **_scaled_rope(keys, g.tensors, g.path, g.arch)}
    return {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": theta}}


def _config(g: GGUFFile) -> Any:
    k = g.keys
    n = g.layers()
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    if int(k.get("attention.value_length", head)) != head:
        refuse(g, "attention.value_length", k["attention.value_length"], f"llama.cpp's Mellum asserts values as "
               f"wide as the keys ({head})")
    whole_head_rotated(g, head)
    unrouted = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors]
    if unrouted:
        raise UnsupportedModelError(f"{g.path}: no blk.{unrouted[0]}.ffn_gate_inp.weight: llama.cpp's Mellum routes "
                                    "every layer through its experts (it loads no dense layer)")
    window = int(k.get("attention.sliding_window", 0) or 0)
    return text_config(
        g, "mellum", num_hidden_layers=n, head_dim=head, hidden_act="silu", attention_bias=False,
        sliding_window=window if window > 0 else None,
        layer_types=["sliding_attention" if s else "full_attention" for s in _sliding(g, n)],
        mlp_layer_types=["sparse"] * n, num_experts=int(k["expert_count"]),
        num_experts_per_tok=int(k["expert_used_count"]), moe_intermediate_size=int(k["expert_feed_forward_length"]),
        norm_topk_prob=True, rope_parameters=_rope(g))


FAMILIES = (Family("mellum", "mellum", "Mellum", _config, values=lambda key, g, config: moe_values(key, g),
                   table="qwen3moe"),)
