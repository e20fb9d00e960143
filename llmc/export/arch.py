"""Architectures llmc exports: map a transformers model to a `ModelSpec` and canonical numpy weights.

Canonical weights are laid out for the graph (MatMul weights as [in, out]; q/k/v and gate/up fused), so the graph
builder never needs to know which checkpoint they came from.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.graph.checkpoint import INV_FREQ, Checkpoint
from llmc.manifest import ModelSpec

LLAMA_FAMILY = {"llama": "Llama 2/3, SmolLM2", "mistral": "Mistral", "qwen2": "Qwen2"}
SUPPORTED = {**LLAMA_FAMILY, "gpt2": "GPT-2"}
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def supported_list() -> str:
    return ", ".join(f"{k} ({v})" for k, v in SUPPORTED.items())


def check_supported(model_type: str) -> None:
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {supported_list()}"
        )


def from_transformers(model: Any) -> Checkpoint:
    """Read spec and weights out of a loaded transformers `*ForCausalLM` (fp32)."""
    config = model.config
    check_supported(config.model_type)
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    if config.model_type == "gpt2":
        return _gpt2(config, state)
    return _llama(model, config, state)


def _llama(model: Any, config: Any, sd: dict[str, np.ndarray]) -> Checkpoint:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} depends on the sequence length; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    rotary = model.model.rotary_emb
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    max_pos = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < max_pos:
        max_pos = int(window)  # within the window, sliding attention is full attention
    tied = bool(getattr(config, "tie_word_embeddings", False))
    spec = ModelSpec(
        family="llama",
        hf_architecture=type(model).__name__,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_positions=max_pos,
        norm="rms",
        norm_eps=float(config.rms_norm_eps),
        activation=_activation(config.hidden_act),
        positions="rope",
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        rope_type=rope_type,
        rope_attention_scaling=float(rotary.attention_scaling),
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in sd,
        tie_embeddings=tied,
    )
    if getattr(config, "mlp_bias", False) or "model.layers.0.self_attn.o_proj.bias" in sd:
        raise UnsupportedModelError("o_proj / MLP biases are not supported for the Llama family")
    w: dict[str, np.ndarray] = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if not tied:
        w["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        qkv = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        w[f"layers.{i}.norm1.weight"] = sd[p + "input_layernorm.weight"]
        w[f"layers.{i}.qkv.weight"] = np.concatenate(qkv, axis=0).T.copy()
        if spec.qkv_bias:
            w[f"layers.{i}.qkv.bias"] = np.concatenate([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        w[f"layers.{i}.o.weight"] = sd[p + "self_attn.o_proj.weight"].T.copy()
        w[f"layers.{i}.norm2.weight"] = sd[p + "post_attention_layernorm.weight"]
        gate_up = [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
        w[f"layers.{i}.gate_up.weight"] = np.concatenate(gate_up, axis=0).T.copy()
        w[f"layers.{i}.down.weight"] = sd[p + "mlp.down_proj.weight"].T.copy()
    w[INV_FREQ] = rotary.inv_freq.detach().float().cpu().numpy()
    return Checkpoint(spec, w)


def _gpt2(config: Any, sd: dict[str, np.ndarray]) -> Checkpoint:
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
        raise UnsupportedModelError("GPT-2 variants with scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn")
    heads = config.n_head
    spec = ModelSpec(
        family="gpt2",
        hf_architecture="GPT2LMHeadModel",
        hidden_size=config.n_embd,
        num_layers=config.n_layer,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=config.n_embd // heads,
        intermediate_size=config.n_inner or 4 * config.n_embd,
        vocab_size=config.vocab_size,
        max_positions=config.n_positions,
        norm="layer",
        norm_eps=float(config.layer_norm_epsilon),
        activation=_activation(config.activation_function),
        positions="learned",
        qkv_bias=True,
        tie_embeddings=True,
    )
    w = {
        "embed.weight": sd["wte.weight"],
        "pos_embed.weight": sd["wpe.weight"],
        "norm.weight": sd["ln_f.weight"],
        "norm.bias": sd["ln_f.bias"],
    }
    for i in range(spec.num_layers):
        p = f"h.{i}."
        # Conv1D weights are already [in, out].
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2"), ("qkv", "attn.c_attn"), ("o", "attn.c_proj"),
                             ("fc", "mlp.c_fc"), ("proj", "mlp.c_proj")):
            w[f"layers.{i}.{ours}.weight"] = sd[p + theirs + ".weight"]
            w[f"layers.{i}.{ours}.bias"] = sd[p + theirs + ".bias"]
    return Checkpoint(spec, w)


def _activation(name: str) -> str:
    if name == "silu":
        return "silu"
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return "gelu_tanh"
    if name == "gelu":
        return "gelu"
    raise UnsupportedModelError(f"activation {name!r} is not supported; supported: silu, gelu, gelu_new")
