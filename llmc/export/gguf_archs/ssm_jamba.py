"""Jamba (Jamba v0.1, Jamba 1.5 / 1.6 / 1.7 Mini and Large, Jamba Reasoning) read as llama.cpp's converter writes it
(`JambaModel` in its conversion/jamba.py):

- **The layer pattern**: transformers' Jamba takes attention and mixture layers as a period and an offset each
  (`attn_layer_period` / `_offset`, `expert_layer_period` / `_offset`), which the file does not hold: the attention
  layers are those of non-zero `attention.head_count_kv` (the per-layer array the converter writes: 0 on a Mamba
  layer, llama.cpp's recurrent layers), the mixture layers those with a router (`ffn_gate_inp`: llama.cpp's test);
  a pattern no period and offset give is refused.
- Mamba-1 mixers with RMS norms on dt, B and C (`ssm_dt_norm`, `ssm_b_norm`, `ssm_c_norm`): A as -exp(A_log)
  ([inner, state]), the depthwise convolution squeezed to [inner, kernel]; the mixer's sizes from `ssm.inner_size`
  (expand x the width), `ssm.state_size`, `ssm.conv_kernel`, `ssm.time_step_rank` (dt's rank).
- Attention without positions, whole heads of width / heads, q / k as they are (`JambaModel` is no `LlamaModel`).
- Each mixture layer's experts stacked per projection (`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`; gate and
  up fused back as transformers holds them); softmax routing without renormalisation (llama.cpp's and transformers').
- The norms' epsilon `attention.layer_norm_rms_epsilon`; the context `context_length`; the vocabulary the
  embeddings' rows (the converter pads nothing)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.moe_common import experts
from llmc.export.gguf_read import Family, GGUFFile, text_config

_MIXER = re.compile(r"model\.layers\.(\d+)\.mamba\.(A_log|conv1d\.weight)")


def _period(g: GGUFFile, layers: list[int], n: int, what: str) -> tuple[int, int]:
    """The period and offset (offset < period) that give exactly `layers` of `n`, as transformers' Jamba takes them."""
    if not layers:
        return n + 1, n  # (none: an offset past the last layer)
    offset = layers[0]
    period = layers[1] - layers[0] if len(layers) > 1 else max(n, offset + 1)
    if [i for i in range(n) if i % period == offset] != layers:
        raise UnsupportedModelError(f"{g.path}: {what} layers {layers} of {n}: transformers' Jamba places them "
                                    "every period layers from an offset")
    return period, offset


def _config(g: GGUFFile) -> Any:
    k = g.keys
    n = int(k["block_count"])
    kv = g.per_layer("attention.head_count_kv", n)
    if len(kv) != n:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.head_count_kv has {len(kv)} values for {n} layers")
    attention = [i for i in range(n) if kv[i]]
    kv_heads = sorted({kv[i] for i in attention})
    if len(kv_heads) > 1:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.head_count_kv {kv}: attention layers of "
                                    "different KV head counts")
    heads = k["attention.head_count"]
    if isinstance(heads, list):
        raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.head_count per layer: transformers' Jamba takes one")
    mixture = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in g.tensors]
    attn_period, attn_offset = _period(g, attention, n, "attention")
    expert_period, expert_offset = _period(g, mixture, n, "mixture")
    hidden, inner = int(k["embedding_length"]), int(k["ssm.inner_size"])
    if inner % hidden:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.ssm.inner_size {inner} is not a whole multiple of the width "
                                    f"{hidden}: transformers' Jamba mixer is expand x the width")
    t = g.tensors
    return text_config(
        g, "jamba", vocab_size=int(t["token_embd.weight"].shape[-1]), num_key_value_heads=kv_heads[0] if kv_heads
        else int(heads), attn_layer_period=attn_period, attn_layer_offset=attn_offset,
        expert_layer_period=expert_period, expert_layer_offset=expert_offset,
        num_experts=int(t[f"blk.{mixture[0]}.ffn_gate_inp.weight"].shape[-1]) if mixture else int(
            k.get("expert_count", 0) or 1),
        num_experts_per_tok=int(k.get("expert_used_count", 0) or 2), mamba_expand=inner // hidden,
        mamba_d_state=int(k["ssm.state_size"]), mamba_d_conv=int(k["ssm.conv_kernel"]),
        mamba_dt_rank=int(k["ssm.time_step_rank"]), rms_norm_eps=float(k["attention.layer_norm_rms_epsilon"]),
        mamba_conv_bias=any(x.endswith("ssm_conv1d.bias") for x in t),
        mamba_proj_bias=any(x.endswith(("ssm_in.bias", "ssm_out.bias")) for x in t), hidden_act="silu")


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    if (values := experts(key, g)) is not None:
        return values
    m = _MIXER.fullmatch(key)
    if m is None:
        return None
    blk = f"blk.{m[1]}"
    if m[2] == "A_log":  # (stored as A = -exp(A_log), [inner, state])
        a = g.read(f"{blk}.ssm_a")
        return None if a is None else np.log(-a.astype(np.float64)).astype(np.float32)
    w = g.read(f"{blk}.ssm_conv1d.weight")  # ([inner, 1, kernel] squeezed)
    return None if w is None else w[:, None, :]


FAMILIES = (Family("jamba", "jamba", "Jamba", _config, values=_values, rope_freqs=False),)
