"""A model's config.json checked before anything is loaded: dimensions that cannot make a model, or one this
machine cannot hold, are a one-line error naming the field, the value and the rule (not a traceback minutes in)."""

from __future__ import annotations

import math
from typing import Any

from llmc.errors import InputError
from llmc.export.arch import MAMBA1_ALONE, SSM_MAX_POSITIONS, STATIC_ROPE_TYPES, scan_heads

# rope types transformers knows beside llmc's (llmc/export/arch.py refuses them by name once the model is loaded)
OTHER_ROPE_TYPES = ("dynamic", "proportional")
# config.json names of the dimensions, per naming scheme (GPT-2 has its own).
_GPT2_NAMES = {"layers": "n_layer", "heads": "n_head", "hidden": "n_embd", "positions": "n_positions"}
_NAMES = {"layers": "num_hidden_layers", "heads": "num_attention_heads", "hidden": "hidden_size",
          "positions": "max_position_embeddings"}
_KIMI_NAMES = (("max_position_embeddings", "model_max_length"), ("num_local_experts", "num_experts"),
               ("num_experts_per_tok", "num_experts_per_token"))  # (Kimi Linear's attribute_map)


def check_config(config: dict[str, Any], where: str) -> None:
    """Raise `InputError` for the first impossible dimension of `config` (from file `where`)."""
    gpt2_names = config.get("model_type") in ("gpt2", "gpt_bigcode", "gptj")
    names = _GPT2_NAMES if gpt2_names else _NAMES
    if config.get("model_type") == "exaone" and "num_layers" in config:  # (EXAONE 3.x's published names)
        names = {**_NAMES, "layers": "num_layers"}
    if config.get("model_type") == "dbrx":  # (its own names; attention's and the MLP's sizes in sub-configs)
        names = {"layers": "n_layers", "heads": "n_heads", "hidden": "d_model", "positions": "max_seq_len"}
        attn, ffn = config.get("attn_config") or {}, config.get("ffn_config") or {}
        config = {**config, "num_key_value_heads": attn.get("kv_n_heads", 1),
                  **{ours: ffn[theirs] for theirs, ours in (("ffn_hidden_size", "intermediate_size"),
                                                            ("moe_num_experts", "num_local_experts"),
                                                            ("moe_top_k", "num_experts_per_tok")) if theirs in ffn}}
    if config.get("model_type") == "mamba2":  # (no attention: its mixers' heads; any length: SSM_MAX_POSITIONS)
        config = {**config, "num_attention_heads": config.get("num_heads"),
                  "max_position_embeddings": SSM_MAX_POSITIONS, "intermediate_size": config.get("hidden_size")}
    if config.get("model_type") in MAMBA1_ALONE:  # (Mamba-1 alone: its channels' heads, as arch.scan_heads)
        hidden = _positive(config, "hidden_size", where)
        channels = _positive({"expand": 2, **config}, "expand", where) * hidden
        heads, width = scan_heads(channels)
        config = {**config, "num_attention_heads": heads, "head_dim": width,
                  "max_position_embeddings": SSM_MAX_POSITIONS, "intermediate_size": hidden}
    if config.get("model_type") == "kimi_linear":  # (its config.json's names for the usual fields)
        config = {**{ours: config[theirs] for ours, theirs in _KIMI_NAMES if theirs in config}, **config}
    if config.get("model_type") == "nemotron_h" and config.get("num_hidden_layers") is None:  # (its blocks' count:
        # layers_block_type's, or hybrid_override_pattern's as published)
        blocks = config.get("layers_block_type") or config.get("hybrid_override_pattern")
        if not isinstance(blocks, list | str) or not blocks:
            raise InputError(f"{where}: layers_block_type (or hybrid_override_pattern) is missing")
        config = {**config, "num_hidden_layers": len(blocks)}
    dims = {k: _positive(config, name, where) for k, name in names.items()}
    vocab = _positive(config, "vocab_size", where)
    heads, hidden = dims["heads"], dims["hidden"]
    kv_heads = _positive(config, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise InputError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                         f"({kv_heads})")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise InputError(f"{where}: {names['hidden']} ({hidden}) must be divisible by {names['heads']} "
                             f"({heads}) when head_dim is not given")
        head_dim = hidden // heads
    else:
        head_dim = _positive(config, "head_dim", where)
    inner_name = "n_inner" if gpt2_names else "ffn_dim" if config.get("model_type") == "opt" else "intermediate_size"
    inner = config.get(inner_name)
    if inner is None:
        inner = 4 * hidden
    if not _is_int(inner) or inner < 1:  # (0 is not "missing": transformers builds an MLP of width 0)
        raise InputError(f"{where}: {inner_name} must be a positive integer, got {inner!r}")
    _check_values(config, where)
    if "kv_lora_rank" in config:  # latent attention (DeepSeek-V2 / V3): its own dimensions, not head_dim's
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _positive(config, name, where)
        if config["qk_rope_head_dim"] % 2:
            raise InputError(f"{where}: qk_rope_head_dim must be even (rotated in pairs), got "
                             f"{config['qk_rope_head_dim']}")
        if config.get("q_lora_rank") is not None:
            _positive(config, "q_lora_rank", where)
    quantization = config.get("quantization_config")
    copies = 1
    if isinstance(quantization, dict) and quantization.get("quant_method") == "bitnet":  # (its master weights, rounded
        # as the model runs, are a second copy where online)
        copies = 2 if quantization.get("quantization_mode") == "online" else 1
    _check_size(where, vocab, hidden, dims["layers"], heads * head_dim, kv_heads * head_dim,
                int(inner) + _experts_width(config, where),
                tied=bool(config.get("tie_word_embeddings", config.get("model_type") == "gpt2")), copies=copies)


def _experts_width(config: dict[str, Any], where: str) -> int:
    """A mixture's experts, as one MLP's width beside the dense one's (its size counts every expert): 0 without."""
    name = next((n for n in ("num_local_experts", "n_routed_experts", "moe_num_experts") if n in config),
                "num_experts")
    if not config.get(name):  # (absent, null or 0: a dense model, as transformers reads it)
        return 0
    experts = _per_layer_positive(config, name, where)
    k_name = next((n for n in ("moe_k", "moe_topk", "top_k_experts") if n in config),  # (ERNIE's, Hunyuan's, Gemma 4's)
                  "num_experts_per_tok")
    per_token = _per_layer_positive(config, k_name, where)
    if per_token > experts:
        raise InputError(f"{where}: {k_name} ({per_token}) must be at most {name} ({experts})")
    width: Any = config.get("moe_intermediate_size", config.get("intermediate_size"))
    return experts * int(width) if _is_int(width) and width > 0 else 0


def _per_layer_positive(config: dict[str, Any], name: str, where: str) -> int:
    """A positive integer, or a list of them (one a layer: Hunyuan's mixtures), as its largest."""
    value = config.get(name)
    if isinstance(value, list) and value and all(_is_int(v) and v > 0 for v in value):
        return max(value)
    return _positive(config, name, where)


def _positive(config: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = config.get(name, default)
    if value is None:
        raise InputError(f"{where}: {name} is missing")
    if not _is_int(value) or value < 1:
        raise InputError(f"{where}: {name} must be a positive integer, got {value!r}")
    return int(value)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_positive_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _check_values(config: dict[str, Any], where: str) -> None:
    """The values that make a model's numbers: norm epsilons, the rotary base and scaling, the window. A bad one
    makes transformers raise (a traceback naming no field) or, worse, compute NaN (an export of nothing)."""
    for name in ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon", "norm_eps", "rope_theta"):
        value = config.get(name)
        if value is not None and not _is_positive_number(value):
            raise InputError(f"{where}: {name} must be a positive number, got {value!r}")
    for name in ("swiglu_alpha", "swiglu_limit"):  # GPT-OSS's experts
        value = config.get(name)
        if config.get("model_type") == "gpt_oss" and value is not None and not _is_positive_number(value):
            raise InputError(f"{where}: {name} must be a positive number, got {value!r}")
    window = config.get("sliding_window")
    if window is not None and (not _is_int(window) or window < 0):
        raise InputError(f"{where}: sliding_window must be a non-negative integer or null, got {window!r}")
    for name in ("rope_parameters", "rope_scaling"):
        params = config.get(name)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise InputError(f"{where}: {name} must be an object, got {params!r}")
        if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3)
            for layer_type, p in params.items():
                _check_rope(f"{name}[{layer_type!r}]", p, where)
        else:
            _check_rope(name, params, where)


def _check_rope(name: str, params: dict[str, Any], where: str) -> None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (*STATIC_ROPE_TYPES, *OTHER_ROPE_TYPES):  # transformers: a KeyError naming no field
        raise InputError(f"{where}: {name} has rope_type {rope_type!r}, not a rotary embedding transformers knows; "
                         f"llmc supports {', '.join(STATIC_ROPE_TYPES)}")
    for key in ("rope_theta", "factor"):  # (a null rope_theta is no default: transformers computes None ** x)
        value = params.get(key)
        if (value is not None or key == "rope_theta" and key in params) and not _is_positive_number(value):
            raise InputError(f"{where}: {name} {key} must be a positive number, got {value!r}")


def _check_size(where: str, vocab: int, hidden: int, layers: int, q: int, kv: int, inner: int, tied: bool,
                copies: int = 1) -> None:
    """Export holds the model in fp32 (torch) while it writes the graphs' weights: it must fit in memory. `copies`:
    how many fp32 copies of the decoder layers' weights it holds at once: one (transformers' copy of each layer is
    let go once the graphs' own are made: release.py), two where a BitNet checkpoint quantizes online (its master
    weights, and the graphs' rounded floats)."""
    import psutil

    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inner
    embeddings = vocab * hidden * (1 if tied else 2)
    params = embeddings + layers * per_layer
    need, have = 4 * (embeddings + copies * layers * per_layer), psutil.virtual_memory().total
    if need > have:
        held = ("the model in fp32" if copies == 1 else
                "an online BitNet checkpoint's decoder products twice in fp32: its master weights and their rounded "
                "floats")
        raise InputError(f"{where}: these dimensions make a model of {params / 1e9:.3g} B parameters, "
                         f"{need / 2**30:,.1f} GiB in fp32 as export holds it, more than this machine's "
                         f"{have / 2**30:.1f} GiB of memory (export holds {held})")
