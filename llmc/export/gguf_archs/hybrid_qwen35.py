"""Qwen3.5 (llama.cpp's `qwen35` -> qwen3_5_text) and Qwen3.5-MoE (`qwen35moe` -> qwen3_5_moe_text), read as
llama.cpp's converter writes them (`Qwen3_5TextModel` / `Qwen3_5MoeTextModel` in its conversion/qwen.py: the MTP
and M-RoPE mixins over `_LinearAttentionVReorderBase`, a `Qwen3NextModel`, a `Qwen2MoeModel`, a `TextModel`):

- **Keys**: `TextModel`'s (the head size as `attention.key_length`, the M-RoPE sections as
  `rope.dimension_sections`, the dense MLP's width, the experts' count and top-k), `Qwen2MoeModel`'s expert widths,
  `Qwen3NextModel`'s mixer keys (`ssm.conv_kernel`, `ssm.state_size` = the key head size, `ssm.group_count` = the
  key heads, `ssm.time_step_rank` = the value heads, `ssm.inner_size` = value heads x value head size), the layer
  pattern as `full_attention_interval` (llama.cpp: layer i is a Gated DeltaNet layer unless (i + 1) % interval is 0,
  as transformers builds `layer_types` from the same key) and the rotated dims (`rope.dimension_count`: a quarter of
  the head in every checkpoint); the multi-token-prediction block as `nextn_predict_layers` extra blocks (left out).
- **Tensors**: every zero-centred RMSNorm (the layers' two, q / k norms, the final norm: all but the Gated
  DeltaNet's own gated norm) stored as 1 + w; A as -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the
  depthwise convolution squeezed to [channels, kernel]; q_proj as it is (each head's queries, then its gate: what
  llama.cpp views); where the value heads outnumber the key heads, every value-head-indexed row / column (in_proj_qkv's
  v rows, in_proj_z, in_proj_a / b, A_log, dt_bias, the convolution's v channels, out_proj's columns) reordered from
  grouped by key head to tiled (`_reorder_v_heads`: llama.cpp repeats the key heads tiled, transformers interleaved);
  the experts stacked per projection (`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`), the router as
  `ffn_gate_inp`, the shared expert as `ffn_*_shexp`, its gate as `ffn_gate_inp_shexp`.

llama.cpp's `qwen35moe` routes by softmax and renormalises the top-k (a literal in its graph), the shared expert
gated by a sigmoid, as transformers' Qwen3.5-MoE does. Positions are text positions: M-RoPE's sections give every
section the same position, so the sections are kept as the file has them and do not change the logits.

Refused: a value head size other than the key head size of the attention (`attention.value_length`), value heads
that are not a multiple of the key heads, an interval below 1, an odd or too large rotated share, an attention
scale other than 1 / sqrt(head size), a recurrent-layer list (`attention.recurrent_layers`, which some llama.cpp
builds read) that is not the interval's pattern."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.moe_common import experts, refuse
from llmc.export.gguf_read import Family, GGUFFile, _scaled_rope, text_config

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# transformers' zero-centred RMSNorms (1 + w): the converter stores 1 + w, llama.cpp multiplies by the weight
_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight")
_DEFAULT_SECTIONS = [11, 11, 10]  # (transformers' and the converter's default)


def _layer_types(g: GGUFFile, n: int) -> list[str]:
    interval = int(g.keys.get("full_attention_interval", 4))
    if interval < 1:
        refuse(g, "full_attention_interval", interval, "not a layer interval")
    types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    listed = g.keys.get("attention.recurrent_layers")
    if listed is not None:
        listed = [bool(v) for v in listed] if isinstance(listed, list) else [bool(listed)] * n
        if listed[:n] != [t == "linear_attention" for t in types]:
            refuse(g, "attention.recurrent_layers", listed, f"not full_attention_interval {interval}'s pattern: "
                   "llama.cpp builds differ on which they follow")
    return types


def _config(g: GGUFFile, model_type: str) -> Any:
    k = g.keys
    n = g.layers()
    hidden, heads = int(k["embedding_length"]), int(k["attention.head_count"])
    head = int(k.get("attention.key_length") or hidden // heads)
    if int(k.get("attention.value_length", head)) != head:
        refuse(g, "attention.value_length", k["attention.value_length"],
               f"beside key_length {head}: transformers' Qwen3.5 has one head size")
    scale = k.get("attention.scale")
    if scale and not math.isclose(float(scale), head ** -0.5, rel_tol=1e-6):
        refuse(g, "attention.scale", scale, f"transformers' Qwen3.5 scales by 1 / sqrt(head size {head})")
    rotated = int(k.get("rope.dimension_count", head))
    if rotated < 2 or rotated % 2 or rotated > head:
        refuse(g, "rope.dimension_count", rotated, f"not an even share of the head size {head}")
    sections = k.get("rope.dimension_sections")
    sections = [int(v) for v in sections][:3] if isinstance(sections, list) else list(_DEFAULT_SECTIONS)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 10_000.0)),
                            "partial_rotary_factor": rotated / head, "mrope_section": sections,
                            "mrope_interleaved": True}
    rope.update(_scaled_rope(k, g.tensors, g.path, g.arch))
    inner, v_heads = int(k["ssm.inner_size"]), int(k["ssm.time_step_rank"])
    k_heads = int(k["ssm.group_count"])
    if v_heads < 1 or k_heads < 1 or inner % v_heads or v_heads % k_heads:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.ssm.inner_size {inner} in {v_heads} value heads "
                                    f"(ssm.time_step_rank) of {k_heads} key heads (ssm.group_count): transformers' "
                                    "Gated DeltaNet shares each key head among a whole number of value heads")
    fields: dict[str, Any] = dict(
        num_hidden_layers=n, layer_types=_layer_types(g, n), head_dim=head, rope_parameters=rope,
        linear_conv_kernel_dim=int(k["ssm.conv_kernel"]), linear_key_head_dim=int(k["ssm.state_size"]),
        linear_value_head_dim=inner // v_heads, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        hidden_act="silu", attention_bias=False)
    if model_type == "qwen3_5_moe_text":
        fields.update(  # (keys Qwen2MoeModel writes for every published config)
            num_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
            moe_intermediate_size=int(k["expert_feed_forward_length"]),
            shared_expert_intermediate_size=int(k["expert_shared_feed_forward_length"]))
        # (no layer of Qwen3.5-MoE is a dense MLP, so transformers' config has no width for one; llmc's export reads
        # the config's intermediate_size all the same: the checkpoint's, where the converter wrote it, else the
        # experts', as in every published config.json that has one)
        fields["intermediate_size"] = int(k.get("feed_forward_length") or fields["moe_intermediate_size"])
    return text_config(g, model_type, **fields)


def _untile(x: np.ndarray, axis: int, k_heads: int, per_key: int, size: int) -> np.ndarray:
    """The inverse of the converter's `_reorder_v_heads`: value heads back from tiled ([per_key, k_heads]) to
    grouped by key head ([k_heads, per_key]) along `axis`, each head `size` wide."""
    if per_key == 1:
        return x
    shape = list(x.shape)
    tiled = x.reshape(*shape[:axis], per_key, k_heads, size, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(tiled, axis, axis + 1)).reshape(shape)


def _linear(what: str, blk: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """A Gated DeltaNet parameter from the converter's layout (None: by the name table: the gated norm)."""
    k_heads, v_heads = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv, r = int(config.linear_key_head_dim), int(config.linear_value_head_dim), v_heads // k_heads

    def back(x: np.ndarray | None, axis: int, size: int) -> np.ndarray | None:
        return None if x is None else _untile(x, axis, k_heads, r, size)

    def per_head(x: np.ndarray) -> np.ndarray:  # (a value per value head: A_log, dt_bias)
        return _untile(x.reshape(-1, 1), 0, k_heads, r, 1).ravel()

    if what == "in_proj_qkv.weight":  # (q, k as they are; v's rows tiled)
        w = g.read(f"{blk}.attn_qkv.weight")
        if w is None:
            return None
        qk = 2 * k_heads * dk
        return np.concatenate([w[:qk], back(w[qk:], 0, dv)], axis=0)
    if what == "in_proj_z.weight":
        return back(g.read(f"{blk}.attn_gate.weight"), 0, dv)
    if what == "in_proj_a.weight":
        return back(g.read(f"{blk}.ssm_alpha.weight"), 0, 1)
    if what == "in_proj_b.weight":
        return back(g.read(f"{blk}.ssm_beta.weight"), 0, 1)
    if what == "A_log":  # (stored as A = -exp(A_log))
        a = g.read(f"{blk}.ssm_a")
        return None if a is None else per_head(np.log(-a.astype(np.float64)).astype(np.float32))
    if what == "dt_bias":  # (renamed dt_proj.bias)
        dt = g.read(f"{blk}.ssm_dt.bias")
        return None if dt is None else per_head(dt)
    if what == "conv1d.weight":  # ([channels, 1, kernel] squeezed; the v channels tiled)
        w = g.read(f"{blk}.ssm_conv1d.weight")
        if w is None:
            return None
        qk = 2 * k_heads * dk
        return np.concatenate([w[:qk], back(w[qk:], 0, dv)], axis=0)[:, None, :]
    if what == "out_proj.weight":  # (its columns tiled)
        return back(g.read(f"{blk}.ssm_out.weight"), 1, dv)
    return None


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    if key == "model.norm.weight":
        norm = g.read("output_norm.weight")
        return None if norm is None else norm - 1
    m = _LAYER.fullmatch(key)
    if m is None:
        return None  # (embeddings, head: gguf's table)
    blk, tail = f"blk.{m[1]}", m[2]
    if tail in _CENTRED:
        norm = g.named(key)
        return None if norm is None else norm - 1
    if tail.startswith("linear_attn."):
        return _linear(tail.removeprefix("linear_attn."), blk, g, config)
    if tail.startswith("mlp.experts.") or tail == "mlp.gate.weight":
        return experts(key, g)
    return None  # (attention products, dense MLP, shared expert and its gate: gguf's table)


FAMILIES = (
    Family("qwen35", "qwen3_5_text", "Qwen3.5", lambda g: _config(g, "qwen3_5_text"), values=_values),
    Family("qwen35moe", "qwen3_5_moe_text", "Qwen3.5-MoE", lambda g: _config(g, "qwen3_5_moe_text"),
           values=_values),
)
