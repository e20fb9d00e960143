"""Mamba-2 and the hybrids built on its mixer, read as llama.cpp's converter writes them (`Mamba2Model`,
`GraniteHybridModel`, `FalconH1Model` in its conversion/mamba.py, granite.py, falcon_h1.py):

- **Mamba-2** (`mamba2`): the mixer's keys (`ssm.inner_size`, `ssm.time_step_rank` = its heads, `ssm.state_size`,
  `ssm.group_count`, `ssm.conv_kernel`); no head count (0). Every Mamba-2 mixer's tensors as the converter stores them:
  A as -exp(A_log) (`ssm_a`, [heads, 1]), D as [heads, 1], the dt bias as `ssm_dt.bias`, the depthwise convolution
  squeezed to [channels, kernel], the gated norm as one row per group ([groups, inner / groups]).
- **Granite 4.0-H** (`granitehybrid` -> granitemoehybrid): the layer pattern as per-layer `attention.head_count_kv`
  (0 on a Mamba layer: llama.cpp's recurrent layers), positions only where `rope.scaling.finetuned` (Bamba's form; no
  rotary at all in Granite 4.0-H), Granite's multipliers as `attention.scale` (none: 1 / sqrt(head size)),
  `embedding_scale`, `residual_scale`, `logit_scale` (none: 1); q / k rows permuted as `LlamaModel` does; the experts'
  fused `input_linear` split into `ffn_gate_exps` / `ffn_up_exps`, the shared MLP's into `ffn_gate_shexp` /
  `ffn_up_shexp` (`ffn_gate` / `ffn_up` / `ffn_down` where there are no experts: the dense hybrids).
- **Bamba** (`BambaForCausalLM`, written by the same `GraniteHybridModel` as `granitehybrid` -> bamba): Granite
  4.0-H's dense form with no multipliers, rotating (`rope.scaling.finetuned`) part of each head
  (`rope.dimension_count`: the checkpoint's `attn_rotary_emb`, half a head). The converter reorders q / k over the
  whole head (`LlamaModel.permute`), which is undone as for Granite: the checkpoint's rows, its model. (llama.cpp
  rotates, its NORM way, adjacent pairs of the first `rope.dimension_count` of the reordered rows: it pairs the
  checkpoint's dims p and head / 2 + p where the checkpoint pairs p and rotated / 2 + p, so its output is not the
  checkpoint's where the rotation is partial; llmc reads the checkpoint's model, which the file holds.)
- **Falcon-H1** (`falcon-h1`): attention and Mamba-2 side by side; the converter multiplies its muP multipliers into
  the weights (embeddings, lm_head, q / k / v, o, the in-projection's z / x / B / C / dt rows, out, the MLP's gate and
  down), so the file's model is Falcon-H1's with every multiplier 1; the gated norm after the gate (llama.cpp's),
  present where the file has `ssm_norm`.

llama.cpp's Mamba-2 adds no in / out projection biases; where a file has them they are read as the config's
(no key says so). The vocabulary is the embeddings' rows: the converter pads the token list (to a multiple of 16,
or 8), not the tensors."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_read import Family, GGUFFile, text_config, unpermute

_MIXER = re.compile(r".*layers\.(\d+)\.(?:mamba|mixer)\.(A_log|D|dt_bias|conv1d\.weight|norm\.weight)")


def vocab_rows(g: GGUFFile) -> int:
    """The embeddings' rows (GGUF's dims run innermost first: [width, vocabulary])."""
    return int(g.tensors["token_embd.weight"].shape[-1])


def mixer_values(key: str, g: GGUFFile) -> np.ndarray | None:
    """A Mamba-2 mixer's parameter from the converter's layout (None: not one it changes)."""
    m = _MIXER.fullmatch(key)
    if m is None:
        return None
    blk, what = f"blk.{m[1]}", m[2]
    if what == "A_log":  # (stored as A = -exp(A_log), [heads, 1])
        a = g.read(f"{blk}.ssm_a")
        return None if a is None else np.log(-a.astype(np.float64)).astype(np.float32).ravel()
    if what == "D":
        d = g.read(f"{blk}.ssm_d")
        return None if d is None else d.ravel()
    if what == "dt_bias":  # (renamed dt_proj.bias by the converter)
        return g.read(f"{blk}.ssm_dt.bias")
    if what == "conv1d.weight":  # ([channels, 1, kernel] squeezed)
        w = g.read(f"{blk}.ssm_conv1d.weight")
        return None if w is None else w[:, None, :]
    norm = g.read(f"{blk}.ssm_norm.weight")  # (one row per group)
    return None if norm is None else norm.ravel()


def mixer_fields(g: GGUFFile) -> dict[str, int]:
    """The mixer's sizes from the file's `ssm.*` keys: heads (`time_step_rank`), head size, groups, state, kernel."""
    k = g.keys
    inner, heads = int(k["ssm.inner_size"]), int(k["ssm.time_step_rank"])
    groups = int(k["ssm.group_count"])
    if heads < 1 or inner % heads or groups < 1 or heads % groups:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.ssm.inner_size {inner} in {heads} heads "
                                    f"(ssm.time_step_rank) of {groups} groups (ssm.group_count)")
    return {"inner": inner, "heads": heads, "head_dim": inner // heads, "groups": groups,
            "state": int(k["ssm.state_size"]), "conv": int(k["ssm.conv_kernel"])}


def _expand(g: GGUFFile, inner: int) -> int:
    hidden = int(g.keys["embedding_length"])
    if inner % hidden:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.ssm.inner_size {inner} is not a whole multiple of the width "
                                    f"{hidden}: transformers' mixer is expand x the width")
    return inner // hidden


def _has(g: GGUFFile, *names: str) -> bool:
    return any(n in g.tensors for n in names)


# ---------------------------------------------------------------- Mamba-2

def _mamba2_config(g: GGUFFile) -> Any:
    m = mixer_fields(g)
    return text_config(
        g, "mamba2", vocab_size=vocab_rows(g), num_heads=m["heads"], head_dim=m["head_dim"], n_groups=m["groups"],
        state_size=m["state"], conv_kernel=m["conv"], expand=_expand(g, m["inner"]),
        layer_norm_epsilon=float(g.keys["attention.layer_norm_rms_epsilon"]), hidden_act="silu",
        use_bias=_has(g, "blk.0.ssm_in.bias", "blk.0.ssm_out.bias"), use_conv_bias=_has(g, "blk.0.ssm_conv1d.bias"))


def _mamba2_values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    return mixer_values(key, g)


# ---------------------------------------------------------------- Granite 4.0-H

def _granite_config(g: GGUFFile) -> Any:
    k = g.keys
    n = int(k["block_count"])
    kv = g.per_layer("attention.head_count_kv", n)
    heads = k["attention.head_count"]
    if isinstance(heads, list) or len(kv) != n:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.head_count {heads} / head_count_kv {kv}: "
                                    "transformers' Granite 4.0-H takes one head count and one KV head count")
    attention = sorted({v for v in kv if v})
    if len(attention) > 1:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.head_count_kv {kv}: attention layers of "
                                    "different KV head counts")
    heads, hidden = int(heads), int(k["embedding_length"])
    head = hidden // heads
    rope = bool(k.get("rope.scaling.finetuned", False))  # (llama.cpp rotates only where set: Bamba's form)
    experts = int(k.get("expert_count", 0) or 0)
    if rope and int(k.get("rope.dimension_count", head)) != head:
        if not _bambas(g, n, kv, head, experts):
            raise UnsupportedModelError(f"{g.path}: {g.arch}.rope.dimension_count {k['rope.dimension_count']} of a "
                                        f"head of {head}: transformers' Granite 4.0-H rotates whole heads, and "
                                        "the file is not Bamba's form (dense, no multipliers)")
        return _bamba_config(g, n, kv, heads, head)
    up = g.tensors.get("blk.0.ffn_up_shexp.weight" if experts else "blk.0.ffn_up.weight")
    shared = int(up.shape[-1]) if up is not None else int(k.get("expert_shared_feed_forward_length", 0))
    m = mixer_fields(g)
    fields: dict[str, Any] = dict(
        vocab_size=vocab_rows(g), num_key_value_heads=attention[0] if attention else heads,
        layer_types=["attention" if v else "mamba" for v in kv],
        position_embedding_type="rope" if rope else None, num_local_experts=experts,
        num_experts_per_tok=int(k.get("expert_used_count", 0) or 0), shared_intermediate_size=shared,
        attention_multiplier=float(k.get("attention.scale") or 1 / math.sqrt(head)),
        embedding_multiplier=float(k.get("embedding_scale") or 1.0),
        residual_multiplier=float(k.get("residual_scale") or 1.0), logits_scaling=float(k.get("logit_scale") or 1.0),
        attention_bias=any(f"blk.{i}.attn_q.bias" in g.tensors for i in range(n)),
        mamba_n_heads=m["heads"], mamba_d_head=m["head_dim"], mamba_n_groups=m["groups"], mamba_d_state=m["state"],
        mamba_d_conv=m["conv"], mamba_expand=_expand(g, m["inner"]), hidden_act="silu",
        mamba_conv_bias=any(f"blk.{i}.ssm_conv1d.bias" in g.tensors for i in range(n)),
        mamba_proj_bias=any(f"blk.{i}.ssm_in.bias" in g.tensors for i in range(n)))
    return text_config(g, "granitemoehybrid", **fields)


def _bambas(g: GGUFFile, n: int, kv: list[int], head: int, experts: int) -> bool:
    """Whether a `granitehybrid` file is Bamba's form: no experts, a dense MLP on every layer, none of Granite's
    multipliers (or the ones Bamba's model has: the query scale 1 / sqrt(head size), the rest 1)."""
    k = g.keys
    ones = all(float(k.get(key) or 1.0) == 1.0 for key in ("embedding_scale", "residual_scale", "logit_scale"))
    scale = k.get("attention.scale")
    return experts == 0 and ones and (not scale or math.isclose(float(scale), head ** -0.5, rel_tol=1e-6)) and \
        all(f"blk.{i}.{name}.weight" in g.tensors for i in range(n) for name in ("ffn_gate", "ffn_up", "ffn_down"))


def _bamba_config(g: GGUFFile, n: int, kv: list[int], heads: int, head: int) -> Any:
    k = g.keys
    m = mixer_fields(g)
    attention = [i for i in range(n) if kv[i]]
    up = g.tensors["blk.0.ffn_up.weight"]
    config = text_config(
        g, "bamba", vocab_size=vocab_rows(g), intermediate_size=int(up.shape[-1]),
        num_key_value_heads=kv[attention[0]] if attention else heads, attn_layer_indices=attention,
        mamba_n_heads=m["heads"], mamba_d_head=m["head_dim"], mamba_n_groups=m["groups"], mamba_d_state=m["state"],
        mamba_d_conv=m["conv"], mamba_expand=_expand(g, m["inner"]), hidden_act="silu",
        attention_bias=any(f"blk.{i}.attn_q.bias" in g.tensors for i in range(n)),
        mlp_bias=any(f"blk.{i}.ffn_up.bias" in g.tensors for i in range(n)),
        mamba_conv_bias=any(f"blk.{i}.ssm_conv1d.bias" in g.tensors for i in range(n)),
        mamba_proj_bias=any(f"blk.{i}.ssm_in.bias" in g.tensors for i in range(n)))
    config.rope_parameters = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 10_000.0)),
                              "partial_rotary_factor": int(k["rope.dimension_count"]) / head}
    return config


def _granite_values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    if (values := mixer_values(key, g)) is not None:
        return values
    parts = key.split(".")
    if len(parts) < 4 or parts[1] != "layers":
        return None
    blk = f"blk.{parts[2]}"
    tail = ".".join(parts[3:])
    if tail.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):  # (LlamaModel.permute, undo_permute = True)
        kind = parts[-1]
        q = tail.startswith("self_attn.q_proj.")
        rows = g.read(f"{blk}.attn_{'q' if q else 'k'}.{kind}")
        heads = config.num_attention_heads if q else config.num_key_value_heads
        return None if rows is None else unpermute(rows, int(heads))
    if config.model_type == "bamba":
        return None  # (the rest by gguf's table: Bamba's feed_forward / pre_ff_layernorm as the dense hybrid's)
    experts = int(config.num_local_experts or 0)
    if tail == "block_sparse_moe.router.weight":
        return g.read(f"{blk}.ffn_gate_inp.weight")
    if tail == "block_sparse_moe.experts.gate_up_proj":  # (input_linear [E, 2I, H] split in two)
        gate, up = g.read(f"{blk}.ffn_gate_exps.weight"), g.read(f"{blk}.ffn_up_exps.weight")
        return None if gate is None or up is None else np.concatenate([gate, up], axis=1)
    if tail == "block_sparse_moe.experts.down_proj":
        return g.read(f"{blk}.ffn_down_exps.weight")
    suffix = "_shexp" if experts else ""
    if tail == "shared_mlp.input_linear.weight":  # (split in gate and up)
        gate, up = g.read(f"{blk}.ffn_gate{suffix}.weight"), g.read(f"{blk}.ffn_up{suffix}.weight")
        return None if gate is None or up is None else np.concatenate([gate, up], axis=0)
    if tail == "shared_mlp.output_linear.weight":
        return g.read(f"{blk}.ffn_down{suffix}.weight")
    return None


# ---------------------------------------------------------------- Falcon-H1

def _falcon_h1_config(g: GGUFFile) -> Any:
    k = g.keys
    for key in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        if isinstance(k.get(key), list):
            raise UnsupportedModelError(f"{g.path}: {g.arch}.{key} per layer: transformers' Falcon-H1 takes one")
    m = mixer_fields(g)
    n = int(k["block_count"])
    ones = dict(embedding_multiplier=1.0, lm_head_multiplier=1.0, key_multiplier=1.0, attention_in_multiplier=1.0,
                attention_out_multiplier=1.0, ssm_in_multiplier=1.0, ssm_out_multiplier=1.0,
                mlp_multipliers=[1.0, 1.0], ssm_multipliers=[1.0] * 5)  # (in the weights: FalconH1Model)
    return text_config(
        g, "falcon_h1", vocab_size=vocab_rows(g), mamba_d_ssm=m["inner"], mamba_n_heads=m["heads"],
        mamba_d_head=m["head_dim"], mamba_n_groups=m["groups"], mamba_d_state=m["state"], mamba_d_conv=m["conv"],
        mamba_expand=max(1, m["inner"] // int(k["embedding_length"])),
        mamba_rms_norm=all(f"blk.{i}.ssm_norm.weight" in g.tensors for i in range(n)),
        mamba_norm_before_gate=False,  # (llama.cpp's build_mamba2_layer: y * silu(z), then the grouped norm)
        mamba_conv_bias=_has(g, "blk.0.ssm_conv1d.bias"), mamba_proj_bias=False, projectors_bias=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu", **ones)


def _falcon_h1_values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    return mixer_values(key, g)


FAMILIES = (
    Family("mamba2", "mamba2", "Mamba-2", _mamba2_config, values=_mamba2_values, rope_freqs=False),
    Family("granitehybrid", "granitemoehybrid", "Granite 4.0-H / Bamba", _granite_config, values=_granite_values),
    Family("falcon-h1", "falcon_h1", "Falcon-H1", _falcon_h1_config, values=_falcon_h1_values),
)
