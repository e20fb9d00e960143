"""Qwen3-Next (Qwen3-Next-80B-A3B Instruct / Thinking, Qwen3-Coder-Next), read as llama.cpp's converter writes it
(`Qwen3NextModel`, a `Qwen2MoeModel`, in its conversion/qwen.py; llama.cpp's `qwen3next`):

- **The layer pattern**: `full_attention_interval` (every n-th layer attends, the others are gated delta-net
  layers; 4 where absent, as llama.cpp), or a per-layer `attention.recurrent_layers` array where a file has one
  (llama.cpp reads it first).
- **Keys**: `TextModel`'s (the width, heads, KV heads, head size as `attention.key_length`, the rotary base and
  scaling, the norms' epsilon, the experts' count and top-k), the experts' and shared expert's widths
  (`expert_feed_forward_length`, `expert_shared_feed_forward_length`), the delta-net's sizes as the `ssm.*` keys
  (`conv_kernel`, `state_size` = the key heads' size, `group_count` = key heads, `time_step_rank` = value heads,
  `inner_size` = value heads x their size), and the rotated dims (`rope.dimension_count`: a quarter of the head in
  every checkpoint; transformers' own default where the config says none, so it is always set here).
- **Tensors**: every RMSNorm stored as 1 + w (transformers' Qwen3-Next norms are 1 + w with w stored: the layers'
  two, the final one, q / k norms), the delta-net's gated norm as it is; A as -exp(A_log) (`ssm_a`); the dt bias as
  `ssm_dt.bias`; the depthwise convolution squeezed to [channels, kernel]; the fused `in_proj_qkvz` (grouped per key
  head: q, k, v, z of each) split into `attn_qkv` (all queries, all keys, all values) and `attn_gate` (z) — a file
  of the first converter holds it as it is (`ssm_in`, llama.cpp's legacy path); `in_proj_ba` as it is (`ssm_ba`);
  the attention's q / gate rows interleaved per head as in the checkpoint (llama.cpp splits them itself), no
  permute; each layer's experts stacked per projection (or fused gate / up), the shared expert's gate as
  `ffn_gate_inp_shexp`. The multi-token-prediction block (`mtp.*`) is not written.

llama.cpp's Qwen3-Next has a mixture with a shared expert on every layer, routes by softmax and always renormalizes
the chosen experts' weights (norm_topk_prob, every checkpoint's), sizes the value heads as the key heads
(`ssm.state_size`), and scales attention by 1 / sqrt(head size). Refused: value heads of another size, an
`expert_weights_scale` other than 1 (none: 1), an `attention.scale` other than 1 / sqrt(head size), sigmoid gating,
a value head size apart from the key's in attention."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.moe_common import experts, layer_of, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config

_SOFTMAX = 1  # (llama.cpp's expert_gating_func values)
# the RMSNorms the converter stores as 1 + w (every `*norm.weight` but the delta-net's gated norm)
_PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
             "self_attn.k_norm.weight")


def layer_types(g: GGUFFile, n: int) -> list[str]:
    """transformers' `layer_types` as llama.cpp tells the layers apart: `attention.recurrent_layers` (true: a
    delta-net layer) where the file has it, else every `full_attention_interval`-th layer attends."""
    k = g.keys
    recurrent = k.get("attention.recurrent_layers")
    if recurrent is not None:
        flags = [bool(v) for v in recurrent] if isinstance(recurrent, list) else [bool(recurrent)] * n
        if len(flags) < n:
            refuse(g, "attention.recurrent_layers", recurrent, f"{len(flags)} values for {n} layers")
        return ["linear_attention" if f else "full_attention" for f in flags[:n]]
    interval = int(k.get("full_attention_interval", 4))
    if interval < 1:
        refuse(g, "full_attention_interval", interval, "not a layer interval")
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]


def delta_net_fields(g: GGUFFile) -> dict[str, int]:
    """The gated delta-net's sizes from the `ssm.*` keys, as transformers' Qwen3-Next names them."""
    k = g.keys
    v_heads, k_heads = int(k["ssm.time_step_rank"]), int(k["ssm.group_count"])
    inner, state = int(k["ssm.inner_size"]), int(k["ssm.state_size"])
    if v_heads < 1 or k_heads < 1 or v_heads % k_heads or inner % v_heads:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.ssm.inner_size {inner} in {v_heads} value heads "
                                    f"(ssm.time_step_rank) over {k_heads} key heads (ssm.group_count)")
    if inner // v_heads != state:  # (llama.cpp sizes the value heads' tensors by the key heads' size)
        refuse(g, "ssm.inner_size", inner, f"value heads of {inner // v_heads} beside key heads of {state} "
               "(ssm.state_size): llama.cpp's Qwen3-Next takes them of one size")
    return dict(linear_conv_kernel_dim=int(k["ssm.conv_kernel"]), linear_key_head_dim=state,
                linear_value_head_dim=inner // v_heads, linear_num_key_heads=k_heads,
                linear_num_value_heads=v_heads)


def _width(g: GGUFFile, key: str, tensor: str, dim: int) -> int:
    """A width from its key, else from the first layer's tensor (GGUF's dims run innermost first)."""
    if g.keys.get(key):
        return int(g.keys[key])
    t = g.tensors.get(tensor)
    if t is None:
        raise KeyError(key)
    return int(t.shape[dim])


def _config(g: GGUFFile) -> Any:
    k = g.keys
    n = int(k["block_count"])
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    if int(k.get("attention.value_length", head)) != head:
        refuse(g, "attention.value_length", k["attention.value_length"], f"beside key_length {head}: "
               "llama.cpp's Qwen3-Next has one head size")
    scale = k.get("attention.scale")
    if scale and not math.isclose(float(scale), head ** -0.5, rel_tol=1e-6):
        refuse(g, "attention.scale", scale, f"transformers' Qwen3-Next scales by 1 / sqrt(head size {head})")
    if int(k.get("expert_gating_func", _SOFTMAX)) != _SOFTMAX:
        refuse(g, "expert_gating_func", k["expert_gating_func"], "Qwen3-Next routes by softmax")
    weights_scale = float(k.get("expert_weights_scale", 0.0) or 0.0)
    if weights_scale not in (0.0, 1.0):
        refuse(g, "expert_weights_scale", weights_scale, "transformers' Qwen3-Next does not scale the experts' "
               "weights")
    if not int(k.get("expert_count", 0) or 0):
        refuse(g, "expert_count", k.get("expert_count", 0), "llama.cpp's Qwen3-Next has experts on every layer")
    rotated = int(k.get("rope.dimension_count", head))
    if not 0 < rotated <= head or rotated % 2:
        refuse(g, "rope.dimension_count", rotated, f"not an even share of the head size {head}")
    from llmc.export.gguf_read import _scaled_rope

    rope = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 10000.0)),
            **_scaled_rope(k, g.tensors, g.path, g.arch), "partial_rotary_factor": rotated / head}
    return text_config(
        g, "qwen3_next", head_dim=head, layer_types=layer_types(g, n), rope_parameters=rope,
        num_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
        moe_intermediate_size=_width(g, "expert_feed_forward_length", "blk.0.ffn_down_exps.weight", 0),
        shared_expert_intermediate_size=_width(g, "expert_shared_feed_forward_length",
                                               "blk.0.ffn_down_shexp.weight", 0),
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu", attention_bias=False,
        **delta_net_fields(g))


def qkvz(g: GGUFFile, blk: str, config: Any) -> np.ndarray | None:
    """`in_proj_qkvz` (rows grouped per key head: its q, k, v, z) from the converter's `attn_qkv` (all q, all k,
    all v) and `attn_gate` (z), or a legacy file's `ssm_in` (the checkpoint's rows as they are)."""
    if f"{blk}.ssm_in.weight" in g.tensors:
        return g.read(f"{blk}.ssm_in.weight")
    qkv, z = g.read(f"{blk}.attn_qkv.weight"), g.read(f"{blk}.attn_gate.weight")
    if qkv is None or z is None:
        return None
    nk, dk = int(config.linear_num_key_heads), int(config.linear_key_head_dim)
    vz = int(config.linear_num_value_heads) // nk * int(config.linear_value_head_dim)  # (v or z rows per key head)
    if qkv.shape[0] != nk * (2 * dk + vz) or z.shape[0] != nk * vz:
        return None  # (mismatched: reported as such)
    h = qkv.shape[1]
    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
    return np.concatenate((q.reshape(nk, dk, h), k.reshape(nk, dk, h), v.reshape(nk, vz, h), z.reshape(nk, vz, h)),
                          axis=1).reshape(-1, h)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    if key == "model.norm.weight":
        w = g.read("output_norm.weight")
        return None if w is None else w - 1.0
    i = layer_of(key)
    if i is None:
        return None  # (embeddings, head: gguf's table)
    if (found := experts(key, g)) is not None:
        return found
    blk, tail = f"blk.{i}", key.split(".", 3)[3]
    if tail in _PLUS_ONE:
        w = g.read(g.names.get_name(key, try_suffixes=(".weight",)))
        return None if w is None else w - 1.0
    if tail == "linear_attn.in_proj_qkvz.weight":
        return qkvz(g, blk, config)
    if tail == "linear_attn.A_log":  # (stored as A = -exp(A_log))
        a = g.read(f"{blk}.ssm_a")
        return None if a is None else np.log(-a.astype(np.float64)).astype(np.float32).ravel()
    if tail == "linear_attn.dt_bias":  # (renamed dt_proj.bias)
        return g.read(f"{blk}.ssm_dt.bias")
    if tail == "linear_attn.conv1d.weight":  # ([channels, 1, kernel] squeezed)
        w = g.read(f"{blk}.ssm_conv1d.weight")
        return None if w is None or w.ndim != 2 else w[:, None, :]
    return None


FAMILIES = (Family("qwen3next", "qwen3_next", "Qwen3-Next", _config, values=_values),)
