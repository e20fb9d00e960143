"""Architectures llmc exports: map a transformers model to a `ModelSpec` and canonical numpy weights.

Canonical weights are laid out for the graph (MatMul weights as [in, out]; q/k/v and gate/up fused; norm weights as
the graph multiplies by them, so Gemma's `1 + w` is folded in here), so the graph builder never needs to know which
checkpoint they came from. Each family adds only what differs from a Llama (`_QUIRKS`); anything a supported family
can be configured with that llmc does not implement is refused, naming the option.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.release import LayerRelease
from llmc.graph.checkpoint import INV_FREQ, INV_FREQ_LOCAL, INV_FREQ_LONG, XIELU, Checkpoint
from llmc.manifest import ModelSpec

SUPPORTED = {
    "llama": "Llama 2/3, SmolLM2", "mistral": "Mistral", "ministral": "Ministral", "qwen2": "Qwen2", "qwen3": "Qwen3",
    "ministral3": "Ministral 3 (text)", "seed_oss": "Seed-OSS", "helium": "Helium", "ernie4_5": "ERNIE 4.5",
    "ernie4_5_moe": "ERNIE 4.5 MoE", "hunyuan_v1_dense": "Hunyuan (dense)", "hunyuan_v1_moe": "Hunyuan MoE (A13B)",
    "arcee": "Arcee AFM", "afmoe": "Arcee Trinity (AFMoE)", "apertus": "Apertus", "exaone4": "EXAONE 4.0",
    "apertus1p5_text": "Apertus 1.5",
    "gemma": "Gemma, CodeGemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3 (text)", "phi": "Phi-1.5, Phi-2",
    "phi3": "Phi-3, Phi-4-mini", "glm": "GLM-4 (glm)", "glm4": "GLM-4-0414", "nemotron": "Nemotron, Minitron",
    "smollm3": "SmolLM3", "cohere": "Command-R, Aya 23", "cohere2": "Command R7B, Command A", "olmo": "OLMo",
    "olmo2": "OLMo 2", "olmo3": "OLMo 3", "stablelm": "StableLM 2", "gpt_neox": "GPT-NeoX, Pythia",
    "starcoder2": "StarCoder2", "granite": "Granite", "granitemoe": "Granite MoE", "mixtral": "Mixtral",
    "qwen2_moe": "Qwen1.5-MoE, Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "glm4_moe": "GLM-4.5, GLM-4.6",
    "dots1": "dots.llm1", "deepseek_v2": "DeepSeek-V2, V2-Lite, V2.5", "deepseek_v3": "DeepSeek-V3, R1, Kimi K2",
    "glm4_moe_lite": "GLM-4.7-Flash", "minimax_m2": "MiniMax-M2", "olmoe": "OLMoE", "gpt_oss": "gpt-oss",
    "falcon": "Falcon (7B, 40B, 180B, Falcon2 11B)", "gptj": "GPT-J", "gpt2": "GPT-2",
    "gpt_bigcode": "StarCoder, SantaCoder", "opt": "OPT", "cwm": "CWM (Code World Model)", "vaultgemma": "VaultGemma",
    "granitemoeshared": "Granite MoE (shared experts)", "exaone": "EXAONE 3.0, 3.5", "nanochat": "nanochat", "solar_open": "Solar Open", "minicpm3": "MiniCPM3",
    "flex_olmo": "FlexOlmo", "exaone_moe": "K-EXAONE (EXAONE MoE)",
    "internlm3": "InternLM3", "iquestcoder": "IQuest-Coder", "sarvam_mla": "Sarvam-105B (latent attention)",
    "param2moe": "Param2-MoE", "sarvam_moe": "Sarvam-30B", "granite_swa": "Granite SWA",
    "granitemoe_swa": "Granite MoE SWA", "hyperclovax": "HyperCLOVA X SEED", "jais2": "Jais 2", "youtu": "Youtu-LLM",
    "minicpm5_moe": "MiniCPM5-MoE", "mellum": "Mellum 2", "flint": "Flint", "hy_v3": "Hy3 (Hunyuan 3)",
    "kolibri1": "Kolibri-1", "kolibri1_1": "Kolibri-1.1", "jetmoe": "JetMoE", "dbrx": "DBRX",
    "cohere2_moe": "Command A MoE (Cohere 2 MoE)", "phimoe": "Phi-3.5-MoE",
    "llama4_text": "Llama 4 (text)",
    "axk1": "A.X K1", "mimo_v2_flash": "MiMo-V2-Flash", "laguna": "Laguna (poolside)",
    "lfm2": "LFM2 (Liquid: gated short convolutions and attention)", "lfm2_moe": "LFM2-MoE (LFM2-8B-A1B)",
    "lfm3": "LFM3", "qwen3_5_text": "Qwen3.5 (text; Gated DeltaNet and gated attention)",
    "qwen3_5_moe_text": "Qwen3.5-MoE (text)", "qwen3_next": "Qwen3-Next", "lara_mini": "Lara Mini",
    "granitemoehybrid": "Granite 4.0-H (Mamba-2 and attention; dense or MoE)", "bamba": "Bamba (Mamba-2 and attention)",
    "nemotron_h": "Nemotron-H, Nemotron Nano 2, Nemotron 3 (Mamba-2, attention, MLP and mixture blocks)",
    "falcon_h1": "Falcon-H1 (attention and Mamba-2 side by side)",
    "kimi_linear": "Kimi Linear (Kimi Delta Attention and latent attention without positions)",
    "mamba2": "Mamba-2, Codestral Mamba (Mamba-2 alone)", "mamba": "Mamba (Mamba-1 alone)",
    "falcon_mamba": "Falcon Mamba (Mamba-1 with normed dt, B and C)",
    "jamba": "Jamba (Mamba-1, attention without positions, mixtures)",
    "zamba2": "Zamba2 (Mamba-2, shared attention blocks on the embeddings with per-use adapters)",
    "olmo_hybrid": "OLMo Hybrid (Gated DeltaNet and OLMo 3's attention)",
    "deepseek_v32": "DeepSeek-V3.2 (up to its index_topk)", "glm_moe_dsa": "GLM-5 (GLM-MoE-DSA; up to its index_topk)",
    "gemma4_text": "Gemma 4 (text: E2B, E4B with per-layer embeddings and KV-shared layers, 31B, 26B-A4B)",
    "bitnet": "BitNet b1.58 (ternary weights, int8 activations)",
}
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
GEMMA = ("gemma", "gemma2", "gemma3_text", "vaultgemma")  # norms that multiply by 1 + w, embeddings times sqrt(hidden)
# their RMSNorms multiply by 1 + w too (not the Gated DeltaNet's own)
ZERO_CENTRED_NORMS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# latent attention (ModelSpec.mla_kv_rank), and of those the dense decoders (no mixture)
MLA = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu", "deepseek_v32",
       "glm_moe_dsa", "axk1")
MLA_DENSE = ("minicpm3", "youtu")
# DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): DeepSeek-V3 whose queries attend the index_topk keys a lightning
# indexer picks; up to index_topk keys that is every key (dense latent attention, exactly), and the export holds no
# more positions (its indexer is not exported)
SPARSE_INDEXED = ("deepseek_v32", "glm_moe_dsa")
# Model types with no modules of their own: transformers builds them as another family (its auto mapping), so they
# are that family with its config's defaults (InternLM3, IQuest-Coder: Llama; Param2, Sarvam-30B: GLM-4.5;
# Sarvam-105B: DeepSeek-V3)
BUILT_AS = {"internlm3": "llama", "iquestcoder": "llama", "param2moe": "glm4_moe", "sarvam_moe": "glm4_moe",
            "sarvam_mla": "deepseek_v3"}

# Image-text checkpoints whose language model is a supported decoder: llmc exports that model (text in, text out; the
# image encoder and its projector are not exported). model_type -> the language model's model_type by default.
VLM_WRAPPERS = {"gemma3": "gemma3_text", "mistral3": "mistral", "qwen2_vl": "qwen2_vl_text",
                "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text",
                "llava": "llama", "llava_next": "llama", "llava_onevision": "qwen2", "smolvlm": "llama",
                "idefics3": "llama", "internvl": "qwen2", "aya_vision": "cohere2", "glm4v": "glm4v_text",
                "glm4v_moe": "glm4v_moe_text", "llama4": "llama4_text", "lfm2_vl": "lfm2",
                "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text",
                "apertus1p5": "apertus1p5_text"}
# Language models with no causal-LM class of their own, and the family they are: Qwen-VL's multimodal rotary gives
# every section the same position on text, which is the family's own rotary.
TEXT_FAMILY = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
               "qwen3_vl_moe_text": "qwen3_moe", "glm4v_text": "glm4", "glm4v_moe_text": "glm4_moe"}
TEXT_FIXED = {"qwen3_vl_moe_text": {"norm_topk_prob": True}}  # (what its modules do whatever the config says)


def supported_list() -> str:
    return (", ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
            + f"; and the language model of image-text checkpoints: {', '.join(VLM_WRAPPERS)}")


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
    state.update(_ternary_weights(model))  # (BitNet's quantized products: the weights they compute with)
    release = LayerRelease(model, state)
    if config.model_type in _LEARNED:
        return _LEARNED[config.model_type](config, state, release)
    return _decoder(model, config, state, release)


# -- the RoPE decoders ------------------------------------------------------------------------------------------

def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def _refuse(option: str, value: Any, why: str = "llmc does not implement it") -> None:
    raise UnsupportedModelError(f"config option {option} = {value!r} is not supported: {why}")


def _common_checks(config: Any, sd: dict[str, np.ndarray]) -> None:
    gated = "model.layers.0.mlp.gate_proj.weight" in sd or "model.layers.0.mlp.gate_up_proj.weight" in sd
    if gated and (_get(config, "mlp_bias", False) or "model.layers.0.mlp.gate_proj.bias" in sd):
        _refuse("mlp_bias", True, "a gated MLP's biases are not implemented")
    bidirectional = _get(config, "use_bidirectional_attention", False)
    if bidirectional and bidirectional != "vision":  # ("vision": image tokens see each other, text stays causal
        # (Gemma 4), and llmc exports the language model for text)
        _refuse("use_bidirectional_attention", bidirectional, "llmc builds causal decoders")


def _decoder(model: Any, config: Any, sd: dict[str, np.ndarray], release: LayerRelease) -> Checkpoint:
    mt = BUILT_AS.get(config.model_type, config.model_type)  # (the family whose modules transformers built)
    sd = _WEIGHT_NAMES.get(mt, lambda c, sd: sd)(config, sd)
    _common_checks(config, sd)
    layers = int(config.num_hidden_layers)
    if mt in ("mamba2", *MAMBA1_ALONE):  # (no attention: its mixers' heads stand in for the attention's, which no
        # layer has)
        config = _mamba_attention(config)
    if mt == "zamba2":  # (its heads 2 x hidden / heads wide: they read [x, the embeddings])
        config = _ConfigView(config, head_dim=int(config.attention_head_dim))
    if mt == "gemma4_text":  # (its config refuses a model-wide head dim: layer 0's stands for it, each layer's own
        # in ModelSpec.layer_head_dims)
        _gemma4_checks(config)
        first = config.per_layer_config[0]
        config = _ConfigView(config, num_key_value_heads=int(first.num_key_value_heads), head_dim=int(first.head_dim))
    heads, kv_heads = int(config.num_attention_heads), int(_get(config, "num_key_value_heads", config.num_attention_heads))
    head_dim = int(_get(config, "head_dim", config.hidden_size // heads))
    tied = bool(_get(config, "tie_word_embeddings", False))
    if _rotary(model) is None:  # (no layer rotates)
        rope, rope_weights = {"rope_layers": (False,) * layers}, dict[str, np.ndarray]()
    else:
        rope, rope_weights = _rope(model, config, head_dim)
        sd = _partial_rotary_halves(model, config, sd, head_dim)
    release.watch(sd)
    fields: dict[str, Any] = dict(
        family="llama", hf_architecture=type(model).__name__, hidden_size=int(config.hidden_size), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=_inner_size(config),
        vocab_size=int(config.vocab_size), max_positions=int(config.max_position_embeddings), norm="rms",
        norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        activation=_activation(_get(config, "hidden_activation", None) or _get(config, "hidden_act", "silu")),
        positions="rope", qkv_bias=_qkv_bias(sd), tie_embeddings=tied, **rope, **_windows(model, config))
    fields.update(_QUIRKS.get(mt, lambda c: {})(config))
    fields.update(_pruned_head(config, sd, tied))
    if mt == "gemma4_text":
        fields.update(_gemma4_layers(config, sd))
    if mt in (*MLA, "kimi_linear"):
        fields.update(_mla(model, config))
    spec = ModelSpec(**fields)
    w = _decoder_weights(spec, sd, fold_norm_offset=mt in (*GEMMA, "nemotron", *ZERO_CENTRED_NORMS), release=release)
    w.update(rope_weights)
    if spec.per_layer_input_size:
        w.update(_per_layer_embedding_weights(spec, sd))
    return Checkpoint(spec, w)


def _pruned_head(config: Any, sd: dict[str, np.ndarray], tied: bool) -> dict[str, Any]:
    """A head with fewer rows than the embeddings (Apertus 1.5: its multimodal output rows pruned): the ids the model
    can produce are its rows' (ModelSpec.output_vocab_size); its inputs stay the whole vocabulary."""
    vocab = int(config.vocab_size)
    if tied:  # (transformers ties the head to the whole embeddings, whatever output_vocab_size says: so do we)
        return {}
    rows = int(sd["lm_head.weight"].shape[0]) if "lm_head.weight" in sd else vocab
    if rows > vocab:
        _refuse("lm_head rows", rows, f"a head wider than the {vocab}-token vocabulary")
    return {"output_vocab_size": rows} if rows < vocab else {}


SSM_MAX_POSITIONS = 262144  # the context of a model without positions or attention (Mamba-2 alone): its state is
# the same size at any length; what an engine is built for (Codestral Mamba's tested length)


class _ConfigView:
    """A transformers config with some fields as the decoder should read them, the rest its own."""

    def __init__(self, config: Any, **fields: Any) -> None:
        self._config = config
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _mamba_attention(config: Any) -> _ConfigView:
    """A Mamba model's config with the attention fields the decoder reads (it has no attention layer): its mixers'
    heads (Mamba-1's channels in scan_heads), no MLP, SSM_MAX_POSITIONS, layer_norm_epsilon as the norms'
    epsilon."""
    heads, head_dim = ((int(config.num_heads), int(config.head_dim)) if config.model_type == "mamba2"
                       else scan_heads(int(config.intermediate_size)))
    return _ConfigView(config, num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                       intermediate_size=int(config.hidden_size), max_position_embeddings=SSM_MAX_POSITIONS,
                       rms_norm_eps=float(config.layer_norm_epsilon))


def _inner_size(config: Any) -> int:
    """The MLP's width, by whichever name the family's config gives it."""
    if config.model_type == "falcon":
        return int(config.ffn_hidden_size)
    if config.model_type == "gptj":
        return int(config.n_inner or 4 * config.hidden_size)
    if config.model_type == "kolibri1" or (config.model_type == "qwen3_5_moe_text" and getattr(
            config, "intermediate_size", None) is None):  # (a mixture in every layer: no dense width)
        return int(config.moe_intermediate_size)
    if config.model_type == "kolibri1_1":  # (its mlp_only_layers')
        return int(config.mlp_only_intermediate_size)
    if config.model_type == "dbrx":
        return int(config.ffn_config.ffn_hidden_size)
    if config.model_type == "llama4_text":  # (its dense layers'; the experts' is intermediate_size)
        return int(config.intermediate_size_mlp)
    if config.model_type == "granitemoehybrid" and not int(config.num_local_experts):  # (its shared MLP alone)
        return int(config.shared_intermediate_size)
    if config.model_type == "lfm2" and config.block_auto_adjust_ff_dim:  # (as Lfm2MLP sizes itself)
        size = int(2 * int(config.intermediate_size) / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            size = config.block_multiple_of * ((size + config.block_multiple_of - 1) // config.block_multiple_of)
        return size
    return int(config.intermediate_size)


def _qkv_bias(sd: dict[str, np.ndarray]) -> bool:
    return any(k.startswith("model.layers.") and k.endswith((".self_attn.q_proj.bias", ".self_attn.qkv_proj.bias"))
               for k in sd)  # (any layer's: LFM's first layers may have no attention)


def _base(model: Any) -> Any:
    """The causal LM's decoder stack (its layers, its rotary module): transformers' base_model, or the `model` of
    one whose base_model prefix names something else (Llama 4's)."""
    base = model.base_model
    return model.model if base is model else base


def _rotary(model: Any) -> Any:
    """transformers' rotary module of the decoder stack (rotary_emb; LFM2-MoE's pos_emb), or None for a model
    without positions (Nemotron-H, Granite 4.0-H without rotary: its Mamba-2 layers order the tokens)."""
    base = _base(model)
    return next((getattr(base, n) for n in ("rotary_emb", "pos_emb") if getattr(base, n, None) is not None), None)


def _windows(model: Any, config: Any) -> dict[str, Any]:
    """Each layer's attention as transformers masks it: sliding (window W) or full. Models whose attention modules
    carry their own `sliding_window` say it per layer; Mistral, Phi-3 and Mixtral apply config.sliding_window to
    every layer."""
    per_layer = []
    base = _base(model)
    for layer in next(getattr(base, n) for n in ("layers", "h", "blocks") if hasattr(base, n)):  # (Falcon: h, DBRX:
        # blocks)
        attn = next((getattr(layer, n) for n in ("self_attn", "attention", "self_attention", "attn", "norm_attn_norm")
                     if hasattr(layer, n)), None)
        if attn is None:  # (a layer without attention: LFM2's convolutions)
            per_layer.append(0)
            continue
        w = attn.sliding_window if hasattr(attn, "sliding_window") else _get(config, "sliding_window", None)
        if not getattr(attn, "is_sliding", True):  # a full layer that keeps the model's window (EXAONE 4)
            w = 0
        per_layer.append(int(w) if w else 0)
    windows = {w for w in per_layer if w}
    if not windows:
        return {}
    if len(windows) > 1:
        _refuse("sliding_window", sorted(windows), "one window size per model")
    (window,) = windows
    if window >= int(config.max_position_embeddings):
        return {}  # never reached: full attention
    types = tuple("sliding_attention" if w else "full_attention" for w in per_layer)
    return {"layer_types": types, "sliding_window": window}


def _rope(model: Any, config: Any, head_dim: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The rotary tables (inverse frequencies) and their spec fields, read from transformers' own rotary module."""
    rotary = _rotary(model)
    params = _get(config, "rope_parameters", None) or _get(config, "rope_scaling", None) or {}
    if config.model_type == "phimoe":
        return _phimoe_rope(rotary, params, head_dim)
    if any(hasattr(rotary, f"{t}_inv_freq") for t in ("full_attention", "sliding_attention")):
        return _per_layer_type_rope(rotary, config, params, head_dim)  # (Gemma 3, OLMo 3, Gemma 4)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if getattr(rotary, "rope_type", None) == "ntk_alpha":  # Hunyuan's "dynamic" with a fixed alpha: a static base
        rope_type = "ntk_alpha"
    if rope_type == "dynamic":  # (InternLM3) transformers' dynamic NTK recomputes its table only for a sequence past
        # max_position_embeddings (until then it is the default one), and an engine never holds more positions
        rope_type = "default"
    if rope_type not in (*STATIC_ROPE_TYPES, "ntk_alpha"):
        _refuse("rope_type", rope_type, f"it depends on the sequence length; supported: {', '.join(STATIC_ROPE_TYPES)}")
    if config.model_type == "gptj":  # (its module holds a sin / cos table: the frequencies as it computes them)
        import torch

        dim = int(config.rotary_dim or head_dim)
        inv_freq, scaling = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim)), 1.0
    else:
        inv_freq = rotary.original_inv_freq if hasattr(rotary, "original_inv_freq") else rotary.inv_freq
        scaling = float(rotary.attention_scaling)
    fields: dict[str, Any] = {"rope_theta": float(params.get("rope_theta", _get(config, "rope_theta", 10000.0))),
                              "rope_type": rope_type, "rope_attention_scaling": scaling}
    weights = {INV_FREQ: _np(inv_freq)}
    rotated = 2 * weights[INV_FREQ].shape[0]
    if rotated != head_dim:
        fields["rotary_dim"] = rotated
    if rope_type == "longrope":
        orig = int(params.get("original_max_position_embeddings") or _get(config, "original_max_position_embeddings"))
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, inv_freq.device, seq_len=orig + 1)
        weights[INV_FREQ_LONG] = _np(long_freq)
        fields["rope_long_after"] = orig
    return fields, weights


def _phimoe_rope(rotary: Any, params: dict[str, Any], head_dim: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """PhiMoE's rotary as transformers computes it: longrope's short-factor table for every length (its long factors
    are never used), times short_mscale, or long_mscale past original_max_position_embeddings (refused unless the
    two are equal, as Phi-3.5-MoE ships them)."""
    rope_type = params.get("rope_type", "default")
    inv_freq = _np(rotary.original_inv_freq)
    if 2 * inv_freq.shape[0] != head_dim:
        _refuse("partial_rotary_factor", params.get("partial_rotary_factor"), "PhiMoE rotates every dim of a head")
    scaling = 1.0
    if rope_type != "default":
        short, long = float(params["short_mscale"]), float(params["long_mscale"])
        if short != long:
            _refuse("rope_parameters.long_mscale", long, f"it differs from short_mscale ({short}): the table's scale "
                    "would depend on the sequence's length")
        scaling = short
    return ({"rope_theta": float(params.get("rope_theta", 10000.0)), "rope_type": rope_type,
             "rope_attention_scaling": scaling}, {INV_FREQ: inv_freq})


# (longrope's second table has no place here; proportional: the first partial_rotary_factor of each head's pairs
# (i, i + D / 2) rotated at base^(-2i / D), the rest at frequency 0, as its table holds them)
PER_LAYER_TYPE_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


def _per_layer_type_rope(rotary: Any, config: Any, params: dict[str, Any],
                         head_dim: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A rotary table per layer type (Gemma 3, OLMo 3): full layers use the global table (scaled as its rope_type
    says), sliding layers their own local one."""
    fields: dict[str, Any] = {}
    weights: dict[str, np.ndarray] = {}
    own_dims = _type_dims(config)  # (Gemma 4: each type rotates the whole of its own heads)
    for layer_type, name in (("full_attention", INV_FREQ), ("sliding_attention", INV_FREQ_LOCAL)):
        if not hasattr(rotary, f"{layer_type}_inv_freq"):
            continue
        p = params.get(layer_type) or {}
        rope_type = p.get("rope_type", "default")
        if rope_type not in PER_LAYER_TYPE_ROPE:
            _refuse(f"rope_parameters[{layer_type!r}].rope_type", rope_type,
                    f"a table per layer type supports {', '.join(PER_LAYER_TYPE_ROPE)}")
        weights[name] = _np(getattr(rotary, f"{layer_type}_original_inv_freq"))
        scaling = float(getattr(rotary, f"{layer_type}_attention_scaling"))
        if own_dims:
            if 2 * len(weights[name]) != own_dims.get(layer_type, 2 * len(weights[name])):
                _refuse(f"rope_parameters[{layer_type!r}]", p, "a model with head dims per layer rotates each whole head")
            widest = head_dim  # (no rotary_dim: each layer rotates its head_dim_of)
        else:
            widest = max(_widths(rotary).values())
        if not own_dims and layer_type in _narrower_types(rotary, head_dim):  # (its layers' q / k turned by _partial_rotary_halves)
            if scaling != 1.0:
                _refuse(f"rope_parameters[{layer_type!r}].partial_rotary_factor", p.get("partial_rotary_factor"),
                        f"its table's scale ({scaling:g}) would fall on the dims it does not rotate")
            weights[name] = np.concatenate([weights[name], np.zeros(widest // 2 - len(weights[name]), np.float32)])
        if widest != head_dim:  # (partial rotary: the widest type's, every type rotating that many dims)
            fields["rotary_dim"] = widest
        if layer_type == "full_attention":
            fields.update(rope_theta=float(p.get("rope_theta", 10000.0)), rope_type=rope_type,
                          rope_attention_scaling=scaling)
        else:
            fields["rope_local_attention_scaling"] = scaling
    if INV_FREQ not in weights:  # every layer slides: the local table serves them all
        weights[INV_FREQ] = weights.pop(INV_FREQ_LOCAL)
        fields["rope_attention_scaling"] = fields.pop("rope_local_attention_scaling", 1.0)
    return fields, weights


def _per_layer_dims(config: Any) -> dict[int, tuple[int, int]]:
    """Each layer's (KV heads, head dim) where they differ between layers (Gemma 4's per_layer_config); empty where
    every layer has the config's own."""
    view = getattr(config, "per_layer_config", None)
    if view is None:
        return {}
    try:
        dims = {i: (int(view[i].num_key_value_heads), int(view[i].head_dim))
                for i in range(int(config.num_hidden_layers))}
    except (AttributeError, KeyError, TypeError, ValueError):  # (a config without per-layer attention fields)
        return {}
    return dims if len(set(dims.values())) > 1 else {}


def _type_dims(config: Any) -> dict[str, int]:
    """Each layer type's head dim, where a config sets head dims per layer (Gemma 4: its full layers' wider)."""
    dims = _per_layer_dims(config)
    return {t: dims[i][1] for i, t in enumerate(config.layer_types)} if dims else {}


def _widths(rotary: Any) -> dict[str, int]:
    """Each layer type's rotated dims, by its per-layer-type table."""
    return {t: 2 * len(getattr(rotary, f"{t}_original_inv_freq")) for t in ("full_attention", "sliding_attention")
            if hasattr(rotary, f"{t}_original_inv_freq")}


def _narrower_types(rotary: Any, head_dim: int) -> set[str]:
    """The layer types that rotate fewer dims than another type (Laguna's full layers: half of a head): their q / k
    are reordered so that they rotate as many as the widest type, the table's extra frequencies 0 (nothing turned)."""
    widths = _widths(rotary) if hasattr(rotary, "full_attention_original_inv_freq") else {}
    return {t for t, w in widths.items() if w < max(widths.values())} if len(set(widths.values())) > 1 else set()


def _partial_rotary_halves(model: Any, config: Any, sd: dict[str, np.ndarray], head_dim: int
                           ) -> dict[str, np.ndarray]:
    """A narrower layer type's layers made to rotate as many dims W as the widest type, exactly: each head's rotated
    pairs (i, i + R/2) moved to (i, i + W/2), its unrotated dims into the other places (q and k rows, their biases
    and per-head norms alike: q . k is the same under one permutation of both); with the type's table padded with
    zero frequencies to W/2 (_per_layer_type_rope) the pairs past R/2 turn by nothing."""
    rotary = _rotary(model)
    narrower = _narrower_types(rotary, head_dim)
    if not narrower or _type_dims(config):  # (each type rotating its own whole heads: Gemma 4)
        return sd
    widths = _widths(rotary)
    out = dict(sd)
    for i, kind in enumerate(config.layer_types):
        if kind not in narrower:
            continue
        half, r = max(widths.values()) // 2, widths[kind] // 2
        rest = iter(range(2 * r, head_dim))
        order = [j if j < r else j - half + r if half <= j < half + r else next(rest) for j in range(head_dim)]
        attn = f"model.layers.{i}.self_attn."
        for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "q_norm.weight",
                     "k_norm.weight"):
            if attn + name in out:
                w = out[attn + name]
                heads = w.reshape(-1, head_dim, *w.shape[1:])
                out[attn + name] = np.ascontiguousarray(heads[:, order].reshape(w.shape))
    return out


def _np(t: Any) -> np.ndarray:
    return t.detach().float().cpu().numpy()


# Per family: the spec fields that differ from a Llama's.
def _qwen3(config: Any) -> dict[str, Any]:
    return {"qk_norm": "head"}


def _gemma(config: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"embedding_scale": float(config.hidden_size) ** 0.5}
    if config.model_type == "gemma":  # Gemma 1: a Llama layer otherwise (GeGLU comes from hidden_act)
        return fields
    fields.update({"norm_layout": "sandwich", "attention_scale": float(config.query_pre_attn_scalar) ** -0.5,
                   "attn_softcap": float(_get(config, "attn_logit_softcapping", 0.0)),
                   "final_softcap": float(_get(config, "final_logit_softcapping", 0.0))})
    if config.model_type == "gemma3_text":
        fields["qk_norm"] = "head"
    if config.model_type == "vaultgemma":  # (Gemma 2's layer with its norms before attention and the MLP only)
        fields["norm_layout"] = "pre"
    return fields


def _gemma4_checks(config: Any) -> None:
    """A Gemma 4 text config llmc cannot build faithfully, refused by name."""
    per_layer_vocab = int(_get(config, "vocab_size_per_layer_input", config.vocab_size))
    if int(_get(config, "hidden_size_per_layer_input", 0)) and per_layer_vocab < int(config.vocab_size):
        _refuse("vocab_size_per_layer_input", per_layer_vocab, f"per-layer embeddings for fewer tokens than the "
                f"vocabulary ({config.vocab_size}): a token past them has none")


def _gemma4(config: Any) -> dict[str, Any]:
    """Gemma 4's text layer: Gemma 3's sandwich norms and per-head q / k norms (their weights multiplied as they
    are, not 1 + w), v normed per head without weights, scores unscaled (its norms set their size), the final
    soft-cap."""
    fields = {"embedding_scale": float(config.hidden_size) ** 0.5, "norm_layout": "sandwich", "attention_scale": 1.0,
              "qk_norm": "head", "v_norm": True, "final_softcap": float(_get(config, "final_logit_softcapping", 0.0))}
    if _get(config, "enable_moe_block", False):  # (26B-A4B) a mixture beside every layer's MLP
        fields.update(_moe(config), moe_beside_mlp=True)
    return fields


def _gemma4_layers(config: Any, sd: dict[str, np.ndarray]) -> dict[str, Any]:
    """Gemma 4's per-layer fields: each layer's head dim and KV heads where they differ, and its layer_scalar."""
    dims = _per_layer_dims(config)
    fields: dict[str, Any] = {}
    if dims:
        fields.update(layer_kv_heads=tuple(dims[i][0] for i in sorted(dims)),
                      layer_head_dims=tuple(dims[i][1] for i in sorted(dims)))
    layers = int(config.num_hidden_layers)
    if int(_get(config, "hidden_size_per_layer_input", 0)):
        fields["per_layer_input_size"] = int(config.hidden_size_per_layer_input)
    scalars = tuple(float(sd[f"model.layers.{i}.layer_scalar"].reshape(-1)[0]) for i in range(layers))
    if any(s != 1.0 for s in scalars):
        fields["layer_scalars"] = scalars
    if _get(config, "attention_k_eq_v", False):  # (its full layers' values are their keys' projection)
        fields["k_eq_v_layers"] = tuple(t != "sliding_attention" for t in config.layer_types)
    modes = config.kv_sharing_modes if int(_get(config, "num_kv_shared_layers", 0)) else [None] * layers
    if "reuse" in modes:  # (E2B / E4B) the last layers read the cache of the last layer of their type before them
        first = modes.index("reuse")
        sources = [i if modes[i] != "reuse" else max(j for j in range(first) if config.layer_types[j] ==
                                                     config.layer_types[i]) for i in range(layers)]
        fields["kv_sources"] = tuple(sources)
        if _get(config, "use_double_wide_mlp", False):  # (and those layers' MLPs are twice as wide)
            inner = int(config.intermediate_size)
            fields["layer_intermediate_sizes"] = tuple(2 * inner if modes[i] == "reuse" else inner
                                                       for i in range(layers))
    return fields


def _per_layer_embedding_weights(spec: ModelSpec, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Gemma 4's per-layer embeddings' weights under llmc's names (ModelSpec.per_layer_input_size)."""
    w = {"embed_per_layer.weight": sd["model.embed_tokens_per_layer.weight"],
         "ple_proj.weight": sd["model.per_layer_model_projection.weight"].T.copy(),
         "ple_norm.weight": sd["model.per_layer_projection_norm.weight"]}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w.update({f"layers.{i}.ple_gate.weight": sd[p + "per_layer_input_gate.weight"].T.copy(),
                  f"layers.{i}.ple_out.weight": sd[p + "per_layer_projection.weight"].T.copy(),
                  f"layers.{i}.ple_norm.weight": sd[p + "post_per_layer_input_norm.weight"]})
    return w


def _gemma4_moe_weights(spec: ModelSpec, sd: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """A Gemma 4 layer's MLP and the mixture beside it (ModelSpec.moe_beside_mlp) under llmc's names: each expert's
    per_expert_scale folded into its down product (the router's weight of an expert times its output), the router's
    scale and 1 / sqrt(hidden) into router_norm's weights."""
    from llmc.graph.moe import DOWN, GATE_UP, ROUTER

    p, q = f"model.layers.{i}.", f"layers.{i}."
    gate_up = np.concatenate([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], axis=0)
    scale = sd[p + "router.per_expert_scale"].astype(np.float32)
    return {q + "gate_up.weight": gate_up.T.copy(), q + "down.weight": sd[p + "mlp.down_proj.weight"].T.copy(),
            q + ROUTER: np.ascontiguousarray(sd[p + "router.proj.weight"].T),
            q + GATE_UP: np.ascontiguousarray(sd[p + "experts.gate_up_proj"].transpose(0, 2, 1)),
            q + DOWN: np.ascontiguousarray(sd[p + "experts.down_proj"].transpose(0, 2, 1) * scale[:, None, None]),
            q + "router_norm.weight": (sd[p + "router.scale"] * np.float32(spec.hidden_size ** -0.5)).astype(np.float32),
            q + "mlp_out_norm.weight": sd[p + "post_feedforward_layernorm_1.weight"],
            q + "moe_in_norm.weight": sd[p + "pre_feedforward_layernorm_2.weight"],
            q + "moe_out_norm.weight": sd[p + "post_feedforward_layernorm_2.weight"]}


def _gemma4_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Gemma 4's v_norm weights (it has none: ones) where a layer has its own keys."""
    out = dict(sd)
    for i in range(int(config.num_hidden_layers)):
        attn = f"model.layers.{i}.self_attn."
        if attn + "k_norm.weight" in out:  # (not a layer reading another's cache)
            out[attn + "v_norm.weight"] = np.ones_like(out[attn + "k_norm.weight"])
    return out


def _smollm3(config: Any) -> dict[str, Any]:
    layers = [bool(x) for x in config.no_rope_layers]
    return {"rope_layers": tuple(layers)} if not all(layers) else {}


def _phi(config: Any) -> dict[str, Any]:  # LayerNorm, partial rotary, a plain MLP, biases; blocks in parallel
    if _get(config, "qk_layernorm", False):
        _refuse("qk_layernorm", True, "a LayerNorm of q and k per head is not implemented")
    return {"norm": "layer", "norm_eps": float(config.layer_norm_eps), "plain_mlp": True,
            "parallel_block": "shared"}


# Phi-2's weights under the names the other families use
_PHI_NAMES = (("self_attn.dense.", "self_attn.o_proj."), ("mlp.fc1.", "mlp.c_fc."), ("mlp.fc2.", "mlp.c_proj."),
              ("model.final_layernorm.", "model.norm."))


def _renamed(sd: dict[str, np.ndarray], names: tuple[tuple[str, str], ...]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in sd.items():
        for theirs, ours in names:
            k = k.replace(theirs, ours)
        out[k] = v
    return out


def _nemotron(config: Any) -> dict[str, Any]:  # LayerNorm of 1 + w, a plain squared-ReLU MLP, partial rotary
    return {"norm": "layer", "norm_eps": float(config.norm_eps), "plain_mlp": True}


def _exaone4(config: Any) -> dict[str, Any]:  # norms after attention and MLP only, qk-norm; global layers without RoPE
    fields: dict[str, Any] = {"norm_layout": "post", "qk_norm": "head"}
    if _get(config, "sliding_window", None):
        fields["rope_layers"] = tuple(t == "sliding_attention" for t in config.layer_types)
    return fields


def _exaone_moe(config: Any) -> dict[str, Any]:  # EXAONE 4's attention with norms before, DeepSeek-V3's mixture
    rope = _exaone4(config).get("rope_layers", ())
    return {**_moe(config), "qk_norm": "head", **({"rope_layers": rope} if rope and not all(rope) else {})}


def _afmoe(config: Any) -> dict[str, Any]:
    """Arcee Trinity: norms before and after attention and the MLP, qk-norm per head, the attention's output gated,
    RoPE on sliding layers only (full ones without), a mixture after num_dense_layers dense layers (sigmoid scores
    + the expert bias choose, renormalized, times route_scale; shared experts added)."""
    rope = tuple(t == "sliding_attention" for t in config.layer_types)
    return {**_moe(config), "norm_layout": "sandwich", "qk_norm": "head", "attn_output_gate": True,
            **({"rope_layers": rope} if not all(rope) else {}),
            **({"embedding_scale": float(config.hidden_size) ** 0.5} if _get(config, "mup_enabled", False) else {})}


_AFMOE_NAMES = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
                (".pre_mlp_layernorm.", ".pre_feedforward_layernorm."),
                (".post_mlp_layernorm.", ".post_feedforward_layernorm."))


def _granite_shared_names(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Granite MoE's shared MLP (input_linear: gate then up rows; output_linear) under the shared experts' names."""
    out = {}
    for k, v in sd.items():
        if ".shared_mlp.input_linear." in k:
            gate, up = np.split(v, 2)
            out[k.replace(".shared_mlp.input_linear.", ".mlp.shared_experts.gate_proj.")] = gate
            out[k.replace(".shared_mlp.input_linear.", ".mlp.shared_experts.up_proj.")] = up
        else:
            out[k.replace(".shared_mlp.output_linear.", ".mlp.shared_experts.down_proj.")] = v
    return out


def _nanochat_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """nanochat's weightless RMSNorms (every block's two, q's and k's, the final one, which also norms the
    embeddings) as norms of weight 1, its MLP (fc1, relu^2, fc2) under the plain MLP's names. Its rotary turns the
    other way (rotate_half with flipped signs): the halves of each head's q and k rows swapped make it Llama's, q . k
    unchanged (the per-head norms after it have no weight: a permutation of the dims leaves them as they are)."""
    hidden, head_dim = int(config.hidden_size), int(config.hidden_size) // int(config.num_attention_heads)
    ones = {"model.norm.weight": hidden, "embed_norm.weight": hidden}
    for i in range(int(config.num_hidden_layers)):
        p = f"model.layers.{i}."
        ones.update({p + "input_layernorm.weight": hidden, p + "post_attention_layernorm.weight": hidden,
                     p + "self_attn.q_norm.weight": head_dim, p + "self_attn.k_norm.weight": head_dim})
    out = _renamed(sd, (("mlp.fc1.", "mlp.c_fc."), ("mlp.fc2.", "mlp.c_proj.")))
    for key in [k for k in out if k.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))]:
        heads = out[key].reshape(-1, head_dim, out[key].shape[-1])
        out[key] = np.ascontiguousarray(np.concatenate([heads[:, head_dim // 2:], heads[:, :head_dim // 2]], 1)
                                        .reshape(out[key].shape))
    return {**{k: np.ones(n, np.float32) for k, n in ones.items()}, **out}


def _kolibri1_1(config: Any) -> dict[str, Any]:
    """Kolibri 1.1 beyond Kolibri-1: indexed-attention layers (ModelSpec.index_layers: NVFP4 keys and values, each
    query's keys chosen by routing scores past index_budget of them) reading the cache of an earlier one of their kind
    where kv_source_layers says so (ModelSpec.kv_sources). Its indexers choose a pool of key blocks only for queries
    seeing more than index_pool_size keys, which an engine does not hold: max_positions is that pool size."""
    types = list(config.layer_types)
    fields: dict[str, Any] = {"index_layers": tuple(t == "indexed_attention" for t in types),
                              "index_topk": int(config.index_topk), "index_local": int(config.index_num_local_tokens),
                              "index_sink": int(config.index_num_sink_tokens),
                              "index_heads": int(config.index_num_heads),
                              "max_positions": min(int(config.max_position_embeddings), int(config.index_pool_size))}
    if not any(fields["index_layers"]):
        return {"max_positions": int(config.max_position_embeddings)}
    sources = tuple(int(s) for s in config.kv_source_layers)
    if any(s != i for i, s in enumerate(sources)):
        fields["kv_sources"] = sources
    return fields


def _apertus(config: Any) -> dict[str, Any]:  # a plain xIELU MLP, qk-norm per head
    return {"plain_mlp": True, "qk_norm": "head"}


def _bitnet(config: Any) -> dict[str, Any]:
    """BitNet b1.58: a Llama with norms before o and down (ModelSpec.sub_norms); as published (quantization_config
    "bitnet") each layer's products take per-token int8 activations (ModelSpec.act_quant) and ternary weights
    (_ternary_weights); its bf16 master weights (no quantization_config) are the same network with neither."""
    quantized = _get(config, "quantization_config") is not None  # (its use_rms_norm refused before it loads)
    return {"sub_norms": True, **({"act_quant": "int8_token"} if quantized else {})}


BITNET_LINEARS = ("BitLinear", "AutoBitLinear")  # transformers' quantized products (integrations/bitnet.py)


def _ternary_weights(model: Any) -> dict[str, np.ndarray]:
    """A BitNet checkpoint's quantized products as the float weights they compute with, by state-dict name: a
    BitLinear's packed 2-bit values (4 a byte, row blocks of out / 4, value + 1) over its weight_scale; an offline
    AutoBitLinear's ternary weight times its weight_scale; an online one's master weight rounded as its forward rounds
    it (to -1, 0, 1 times 1 / s, s = 1 / max(mean |W|, 1e-5), in torch: the same float arithmetic). Every decoder
    product must be one of them (their inputs are rounded to int8 per token: ModelSpec.act_quant); {} for other
    models."""
    import torch

    modules = dict(model.named_modules())
    quantized = {name: m for name, m in modules.items() if type(m).__name__ in BITNET_LINEARS}
    if not quantized:
        return {}
    plain = sorted(name for name, m in modules.items() if isinstance(m, torch.nn.Linear)
                   and name not in quantized and name.startswith("model.layers."))
    if plain:
        _refuse("quantization_config.modules_to_not_convert", plain[0],
                "llmc rounds every decoder product's input to int8 (a product left in float is not implemented)")
    out = {}
    for name, m in quantized.items():
        w = m.weight.detach()
        if type(m).__name__ == "BitLinear":
            packed = w.cpu().numpy().astype(np.uint8)  # [out / 4, in]
            values = np.concatenate([(packed >> (2 * i)) & 3 for i in range(4)], axis=0).astype(np.float32) - 1
            weight = values[:m.out_features] / np.float32(m.weight_scale.detach().float().item())
        elif getattr(m, "online_quant", False):
            with torch.no_grad():
                wf = w.float()
                s = 1.0 / wf.abs().mean().clamp_(min=1e-5)
                weight = ((wf * s).round().clamp(-1, 1) / s).numpy()
        elif w.dtype == torch.float32:  # an offline AutoBitLinear (ternary w times weight_scale) as loaded: the scale
            # folded into its weight in place, where a product of its own held the layer twice more (bitnet-b1.58-2B-4T's
            # export was killed past 24 GB on a 23 GiB machine): w s is exact for w in {-1, 0, 1}, and the module then
            # sums x (w s) for (x w) s, the same to float32's rounding
            with torch.no_grad():
                w.mul_(m.weight_scale.detach().float())
                m.weight_scale.fill_(1.0)
            weight = w.numpy()
        else:
            weight = (w.float() * m.weight_scale.detach().float()).numpy()
        out[f"{name}.weight"] = np.ascontiguousarray(weight, dtype=np.float32)
    return out


@contextmanager
def without_rounding() -> Iterator[None]:
    """transformers' BitNet products with their inputs as they are (no int8 rounding), while in the block: the
    network ModelSpec.act_quant "" describes, which an export's graphs without their rounding must match exactly."""
    import torch
    from transformers.integrations import bitnet

    def unrounded(self: Any, x: Any, num_bits: int = 8) -> tuple[Any, Any]:  # (BitLinear: y / (1 * weight_scale))
        return x, torch.ones((), dtype=x.dtype)

    def as_it_is(x: Any) -> Any:  # (AutoBitLinear's ActQuant)
        return x

    saved = [(cls, name, cls.__dict__.get(name)) for cls, name in ((bitnet.ActQuant, "apply"),
                                                                     (bitnet.BitLinear, "activation_quant"))]
    setattr(bitnet.ActQuant, "apply", as_it_is)  # noqa: B010 - (mypy: a method assigned)
    setattr(bitnet.BitLinear, "activation_quant", unrounded)  # noqa: B010
    try:
        yield
    finally:
        for cls, name, own in saved:  # (ActQuant's apply is torch.autograd.Function's: inherited again)
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)


def _arcee(config: Any) -> dict[str, Any]:  # a plain squared-ReLU MLP
    return {"plain_mlp": True}


def _glm(config: Any) -> dict[str, Any]:  # interleaved partial rotary (reordered at export); GLM-4-0414: sandwich norms
    return {"norm_layout": "sandwich"} if config.model_type == "glm4" else {}


# GLM-4-0414's norms under Gemma 2's names (the same four places), each renamed once
_GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
               "post_attention_layernorm": "pre_feedforward_layernorm",
               "post_mlp_layernorm": "post_feedforward_layernorm"}


def _glm_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = _layer_part_names(sd, _GLM4_NORMS) if config.model_type == "glm4" else sd
    params = _get(config, "rope_parameters", None) or {}
    rotated = float(params.get("partial_rotary_factor", _get(config, "partial_rotary_factor", 1.0)) or 1.0)
    return _interleaved_to_halves(config, out, rotated)


def _olmo(config: Any) -> dict[str, Any]:  # LayerNorm without weights (eps 1e-5), q/k/v clamped
    return {"norm": "layer", "norm_eps": 1e-5, **_clip_qkv(config)}


def _clip_qkv(config: Any) -> dict[str, Any]:  # OLMo, OLMoE: q, k (after their norms) and v clamped to +-clip
    clip = _get(config, "clip_qkv", None)
    return {"clip_qkv": float(clip)} if clip else {}


def _norm_params(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights (1) and biases (0) of LayerNorms a model has without them (OLMo: neither; Cohere: no bias), as
    LayerNormalization takes them."""
    hidden = int(config.hidden_size)
    ones, zeros = np.ones(hidden, np.float32), np.zeros(hidden, np.float32)
    names = ["model.norm"] + [f"model.layers.{i}.{n}" for i in range(int(config.num_hidden_layers))
                              for n in ("input_layernorm", "post_attention_layernorm")]
    return {**{f"{n}.weight": ones for n in names}, **{f"{n}.bias": zeros for n in names}, **sd}


def _cohere(config: Any) -> dict[str, Any]:  # LayerNorm without bias, attention and MLP in parallel, logits scaled
    if _get(config, "use_qk_norm", False):
        _refuse("use_qk_norm", True, "a LayerNorm of q and k per head is not implemented")
    return {"norm": "layer", "norm_eps": float(config.layer_norm_eps), "parallel_block": "shared",
            "logits_scaling": 1.0 / float(config.logit_scale)}


def _uniform(config: Any, *names: str) -> Any:
    """A copy of the config with each named per-layer list (Hunyuan's) read as its one value; lists that differ are
    refused."""
    import copy

    config = copy.copy(config)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, list | tuple):
            if len(set(value)) != 1:
                _refuse(name, value, "llmc builds one mixture shape for every layer")
            setattr(config, name, value[0])
    return config


def _cohere2(config: Any) -> dict[str, Any]:  # Cohere's, with sliding layers rotated and full layers without RoPE
    return {**_cohere(config), "rope_layers": tuple(t == "sliding_attention" for t in config.layer_types)}


def _cohere2_moe(config: Any) -> dict[str, Any]:
    """Cohere 2's layer (RMSNorm where rms_norm_eps is set, else its LayerNorm) with RoPE on sliding layers and, where
    prefix_dense_sliding_window_pattern is 1, on its dense layers too; a mixture where mlp_layer_types says sparse
    (softmax over the top k logits, or their sigmoids: "sigmoid" routing with no bias), dense layers
    prefix_dense_intermediate_size wide."""
    dense = [t == "dense" for t in config.mlp_layer_types]
    forced = int(config.prefix_dense_sliding_window_pattern) == 1
    rope = tuple(t == "sliding_attention" or (d and forced) for t, d in zip(config.layer_types, dense))
    width = _get(config, "prefix_dense_intermediate_size", None)
    return {**_cohere(config), **_moe(config), "rope_layers": rope,
            **({"norm": "rms", "norm_eps": float(config.rms_norm_eps)} if _get(config, "rms_norm_eps", None) else {}),
            **({"intermediate_size": int(width)} if width else {})}


def _cohere2_moe_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Cohere 2 MoE's weights as Cohere 2's; its "average" of routed and shared experts ((r + s) / 2) as every
    expert's down product halved (exact)."""
    from llmc.graph.moe import is_sparse_layer

    out = _interleaved_to_halves(config, sd if _get(config, "rms_norm_eps", None) else _norm_params(config, sd))
    for i in range(int(config.num_hidden_layers)):
        if not is_sparse_layer(config, i):
            continue
        p = f"model.layers.{i}.mlp."
        if int(config.num_shared_experts) and config.shared_expert_combination_strategy == "average":
            for name in (p + "experts.down_proj", p + "shared_experts.down_proj.weight"):
                out[name] = out[name] * np.float32(0.5)
    return out


def _interleaved_to_halves(config: Any, sd: dict[str, np.ndarray], rotated: float = 1.0) -> dict[str, np.ndarray]:
    """Cohere and GLM rotate each head's pairs (2i, 2i + 1); llmc, as Llama, the halves (i, i + R/2) with the same
    frequency i (R: the rotated dims, the first `rotated` of each head). q . k is the same under one permutation of
    both, so each head's q and k rows are reordered (its rotated dims even then odd, the rest as they are) and its
    rotary becomes Llama's; v and o are untouched."""
    out = dict(sd)
    heads = int(config.num_attention_heads)
    kv_heads = int(_get(config, "num_key_value_heads", heads))
    for i in range(int(config.num_hidden_layers)):
        for name, n in (("q_proj", heads), ("k_proj", kv_heads)):
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.self_attn.{name}.{kind}"
                if key in out:
                    w = out[key].reshape(n, -1, *out[key].shape[1:])  # [heads, D, ...]
                    r = int(w.shape[1] * rotated)
                    order = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2), np.arange(r, w.shape[1])])
                    out[key] = np.ascontiguousarray(w[:, order].reshape(out[key].shape))
    return out


def _gpt_neox(config: Any) -> dict[str, Any]:  # LayerNorm, partial rotary, a plain MLP, biases; blocks in parallel
    return {"norm": "layer", "norm_eps": float(config.layer_norm_eps), "plain_mlp": True,
            **({"parallel_block": "two"} if config.use_parallel_residual else {})}


def _gpt_neox_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT-NeoX's weights under the names the other families use; its fused q/k/v rows, interleaved per head
    ([H, 3, D]), split into q, k and v."""
    names = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
             ("gpt_neox.layers.", "model.layers."), (".attention.dense.", ".self_attn.o_proj."),
             ("mlp.dense_h_to_4h.", "mlp.c_fc."), ("mlp.dense_4h_to_h.", "mlp.c_proj."))
    out = _renamed(sd, names)
    heads = int(config.num_attention_heads)
    for key in [k for k in out if ".attention.query_key_value." in k]:
        fused = out.pop(key)  # [H * 3 * D, hidden] or [H * 3 * D]
        parts = fused.reshape(heads, 3, -1, *fused.shape[1:])
        for j, name in enumerate("qkv"):
            out[key.replace(".attention.query_key_value.", f".self_attn.{name}_proj.")] = \
                np.ascontiguousarray(parts[:, j].reshape(-1, *fused.shape[1:]))
    return out


def _falcon(config: Any) -> dict[str, Any]:
    """Falcon: LayerNorm with bias, a plain MLP; attention and MLP in parallel off one norm (7B, Falcon2 11B) or two
    (40B, 180B: `new_decoder_architecture`), or one after the other (`parallel_attn` false)."""
    if _get(config, "alibi", False):
        _refuse("alibi", True, "ALiBi position biases are not implemented (llmc's Falcons are rotary)")
    if config.new_decoder_architecture:  # (always in parallel)
        parallel = "two" if int(_get(config, "num_ln_in_parallel_attn", 2)) == 2 else "shared"
    else:
        parallel = "shared" if config.parallel_attn else ""
    return {"norm": "layer", "norm_eps": float(config.layer_norm_epsilon), "plain_mlp": True,
            "activation": _activation(config.activation), **({"parallel_block": parallel} if parallel else {})}


def _falcon_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Falcon's weights under the names the other families use; its fused q/k/v rows split into q, k and v: per KV
    group [its queries, key, value] (`new_decoder_architecture`), [queries, key, value] (`multi_query`), or
    interleaved per head ([H, 3, D])."""
    names = (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
             ("transformer.h.", "model.layers."), (".self_attention.dense.", ".self_attn.o_proj."),
             ("mlp.dense_h_to_4h.", "mlp.c_fc."), ("mlp.dense_4h_to_h.", "mlp.c_proj."),
             (".ln_attn.", ".input_layernorm."), (".ln_mlp.", ".post_attention_layernorm."))
    out = _renamed(sd, names)
    heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
    kv = int(config.num_kv_heads) if config.new_decoder_architecture else 1 if config.multi_query else heads
    D = hidden // heads
    for key in [k for k in out if ".self_attention.query_key_value." in k]:
        fused = out.pop(key)  # [rows, hidden] or [rows]
        rest = fused.shape[1:]
        if config.new_decoder_architecture:
            groups = fused.reshape(kv, heads // kv + 2, D, *rest)
            q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
        elif config.multi_query:
            q, k, v = np.split(fused.reshape(heads + 2, D, *rest), [heads, heads + 1])
        else:
            q, k, v = (fused.reshape(heads, 3, D, *rest)[:, j] for j in range(3))
        for name, part in zip("qkv", (q, k, v)):
            out[key.replace(".self_attention.query_key_value.", f".self_attn.{name}_proj.")] = \
                np.ascontiguousarray(part.reshape(-1, *rest))
    return out


def _ministral3(config: Any) -> dict[str, Any]:
    """Mistral's layer; past original_max_position_embeddings its queries grow by llama_4_scaling_beta's log."""
    params = _get(config, "rope_parameters", None) or {}
    beta = float(params.get("llama_4_scaling_beta") or 0.0)
    if not beta:
        return {}
    after = int(params.get("original_max_position_embeddings") or 0)
    if after <= 0:
        _refuse("rope_parameters.original_max_position_embeddings", after, "llama_4_scaling_beta needs it positive")
    return {"query_scale_beta": beta, "query_scale_after": after}


def _gptj(config: Any) -> dict[str, Any]:  # LayerNorm with bias, a plain MLP, attention and MLP off one norm
    return {"norm": "layer", "norm_eps": float(config.layer_norm_epsilon), "plain_mlp": True,
            "parallel_block": "shared", "activation": _activation(config.activation_function)}


_GPTJ_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
               ("transformer.h.", "model.layers."), (".ln_1.", ".input_layernorm."), (".attn.", ".self_attn."),
               (".self_attn.out_proj.", ".self_attn.o_proj."), ("mlp.fc_in.", "mlp.c_fc."),
               ("mlp.fc_out.", "mlp.c_proj."))


def _gptj_rotated(config: Any) -> float:
    """The share of each head GPT-J rotates (over interleaved pairs: made halves at export, as Cohere's)."""
    head_dim = int(config.n_embd) // int(config.n_head)
    return int(config.rotary_dim or head_dim) / head_dim


def _stablelm(config: Any) -> dict[str, Any]:  # LayerNorm with bias, partial rotary; attention and MLP in parallel
    if _get(config, "qk_layernorm", False):
        _refuse("qk_layernorm", True, "a LayerNorm of its own for each head is not implemented")
    return {"norm": "layer", "norm_eps": float(config.layer_norm_eps),
            **({"parallel_block": "shared"} if config.use_parallel_residual else {})}


def _starcoder2(config: Any) -> dict[str, Any]:  # LayerNorm with bias, a plain GELU MLP, biases everywhere
    return {"norm": "layer", "norm_eps": float(config.norm_epsilon), "plain_mlp": True}


def _olmo2(config: Any) -> dict[str, Any]:
    return {"norm_layout": "post", "qk_norm": "full"}


def _granite(config: Any) -> dict[str, Any]:
    return {"embedding_scale": float(config.embedding_multiplier), "residual_scale": float(config.residual_multiplier),
            "attention_scale": float(config.attention_multiplier), "logits_scaling": float(config.logits_scaling)}


def _granite_swa(config: Any) -> dict[str, Any]:
    """Granite SWA: Granite's multipliers, a learned sink per head (GPT-OSS's), sliding / full layers, and each
    layer's rotary base (`layer_rope_theta`; 0: a layer without rotary)."""
    fields = {**_granite(config), "attn_sinks": True}
    thetas = [float(t) for t in (_get(config, "layer_rope_theta", None) or [])]
    base = float((_get(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    if any(t and t != base for t in thetas):  # (the model's one table is built from rope_theta)
        _refuse("layer_rope_theta", thetas, f"llmc rotates every layer by rope_theta ({base:g}) or not at all")
    if thetas and not all(thetas):
        fields["rope_layers"] = tuple(bool(t) for t in thetas)
    return fields


def _dbrx(config: Any) -> dict[str, Any]:
    """DBRX: LayerNorm without bias, its fused q/k/v clamped, a mixture in every layer (softmax, top k, the k weights
    renormalized by their sum where moe_normalize_expert_weights is 1, as they are where it is None)."""
    ffn, attn = config.ffn_config, config.attn_config
    if ffn.moe_normalize_expert_weights not in (None, 1):
        _refuse("ffn_config.moe_normalize_expert_weights", ffn.moe_normalize_expert_weights,
                "the routing weights renormalized by their sum (1) or not at all (None)")
    built = float((_get(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    theta = _get(attn, "rope_theta", None)
    if theta is not None and float(theta) != built:  # (transformers builds the table from rope_parameters)
        _refuse("attn_config.rope_theta", theta, f"transformers rotates DBRX by rope_parameters' rope_theta "
                f"({built:g}), not by this; give config.json the same rope_parameters.rope_theta to export the model "
                "as it was trained")
    return {"norm": "layer", "norm_eps": 1e-5, "activation": _activation(ffn.ffn_act_fn.get("name", "silu")),
            **_moe(config), **({"clip_qkv": float(attn.clip_qkv)} if _get(attn, "clip_qkv", None) else {})}


def _dbrx_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """DBRX's weights under Llama's and Mixtral's names: experts' w1 (gate), v1 (up) and w2 ([E * I, hidden] each) as
    gate_up_proj [E, 2I, hidden] and down_proj [E, hidden, I]; its bias-free LayerNorms given zero biases."""
    experts, width = int(config.ffn_config.moe_num_experts), int(config.ffn_config.ffn_hidden_size)
    out = _renamed({k: v for k, v in sd.items() if ".ffn.experts.mlp." not in k}, _DBRX_NAMES)
    for i in range(int(config.num_hidden_layers)):
        raw, canonical = f"transformer.blocks.{i}.ffn.experts.mlp.", f"model.layers.{i}.mlp.experts."
        gate, up, down = (sd[raw + n].reshape(experts, width, -1) for n in ("w1", "v1", "w2"))
        out[canonical + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
        out[canonical + "down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1))
    return _norm_params(config, out)


# JetMoE's MLP mixture under Mixtral's names (its input_linear is gate_up_proj's [E, 2I, hidden], gate rows first),
# the bias it adds after the mixture named for _mlp_weights; its attention under self_attn
_JETMOE_NAMES = ((".self_attention.", ".self_attn."), (".mlp.router.layer.", ".mlp.gate."),
                 (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
                 (".mlp.output_linear.weight", ".mlp.experts.down_proj"), (".mlp.bias", ".mlp.moe_output_bias"))
_DBRX_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
               ("transformer.blocks.", "model.layers."), (".norm_attn_norm.norm_1.", ".input_layernorm."),
               (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
               (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
               (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."), (".ffn.router.layer.", ".mlp.gate."))


def _lfm2(config: Any) -> dict[str, Any]:
    """LFM2: "conv" layers (a gated short convolution) among attention layers with a qk-norm per head; LFM3's
    attention layers full or sliding (a rotary table per type), gated per head (`use_attention_gate`), its norms
    also after the blocks (`use_sandwich_norm`)."""
    fields = {"layer_types": tuple(t if t in ("conv", "sliding_attention") else "full_attention"
                                   for t in config.layer_types),
              "conv_kernel": int(config.conv_L_cache), "qk_norm": "head", "norm_eps": float(config.norm_eps)}
    if config.model_type == "lfm3":
        if float(_get(config, "rms_norm_eps", config.norm_eps)) != float(config.norm_eps):
            _refuse("rms_norm_eps", config.rms_norm_eps, f"one eps for every norm (norm_eps is {config.norm_eps})")
        fields.update(attn_output_gate=bool(config.use_attention_gate),
                      norm_layout="sandwich" if config.use_sandwich_norm else "pre")
    return fields


_LFM2_NAMES = ((".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
               (".self_attn.out_proj.", ".self_attn.o_proj."), (".q_layernorm.", ".q_norm."),
               (".k_layernorm.", ".k_norm."), (".feed_forward.w1.", ".mlp.gate_proj."),
               (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
               ("model.embedding_norm.", "model.norm."), (".feed_forward.", ".mlp."),  # (LFM2-MoE's mixture)
               (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))
_LFM3_SANDWICH = ((".post_operator_norm.", ".post_attention_layernorm."), (".operator_norm.", ".input_layernorm."),
                  (".post_ffn_norm.", ".post_feedforward_layernorm."), (".ffn_norm.", ".pre_feedforward_layernorm."))


def _lfm3_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """LFM2's names (its four norms where use_sandwich_norm places them), the per-head gate as Laguna's."""
    sd = _renamed(sd, _LFM3_SANDWICH) if config.use_sandwich_norm else sd
    return _laguna_names(config, _renamed(sd, _LFM2_NAMES))


def _qwen3_5(config: Any) -> dict[str, Any]:
    """Qwen3.5: Gated DeltaNet layers ("linear_attention") among gated attention layers (the output times
    sigmoid of q_proj's second half per head), a qk-norm per head, zero-centred norms (1 + w: folded at export)."""
    if str(_get(config, "hidden_act", "silu")) != "silu":
        _refuse("hidden_act", config.hidden_act, "the Gated DeltaNet's convolution is built with SiLU")
    return {"layer_types": tuple(config.layer_types), "qk_norm": "head", "attn_output_gate": True,
            "linear_k_heads": int(config.linear_num_key_heads), "linear_v_heads": int(config.linear_num_value_heads),
            "linear_k_dim": int(config.linear_key_head_dim), "linear_v_dim": int(config.linear_value_head_dim),
            "linear_conv_kernel": int(config.linear_conv_kernel_dim)}


def _qwen3_5_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each attention layer's q_proj ([H, 2, D] rows: the head's queries, then its gate) split into q_proj and the
    per-element gate_proj."""
    out = dict(sd)
    heads, head_dim = int(config.num_attention_heads), int(config.head_dim)
    for name in [k for k in sd if k.endswith("self_attn.q_proj.weight")]:
        both = out.pop(name).reshape(heads, 2, head_dim, -1)
        out[name] = np.ascontiguousarray(both[:, 0].reshape(heads * head_dim, -1))
        out[name.replace("q_proj", "gate_proj")] = np.ascontiguousarray(both[:, 1].reshape(heads * head_dim, -1))
    return out


def _qwen3_next_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused Gated DeltaNet products as Qwen3.5's: in_proj_qkvz's rows per key head [q, k, v (its
    value heads'), z] and in_proj_ba's [b, a] regrouped as in_proj_qkv (every head's q, then k, then v), in_proj_z,
    in_proj_b and in_proj_a."""
    hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv, r = int(config.linear_key_head_dim), int(config.linear_value_head_dim), hv // hk
    out = dict(sd)
    for name in [k for k in sd if k.endswith("linear_attn.in_proj_qkvz.weight")]:
        p = name.removesuffix("in_proj_qkvz.weight")
        qkvz = out.pop(name).reshape(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        out[p + "in_proj_qkv.weight"] = np.concatenate([x.reshape(-1, x.shape[-1]) for x in (q, k, v)], axis=0)
        out[p + "in_proj_z.weight"] = np.ascontiguousarray(z.reshape(hv * dv, -1))
        ba = out.pop(p + "in_proj_ba.weight").reshape(hk, 2 * r, -1)
        out[p + "in_proj_b.weight"] = np.ascontiguousarray(ba[:, :r].reshape(hv, -1))
        out[p + "in_proj_a.weight"] = np.ascontiguousarray(ba[:, r:].reshape(hv, -1))
    return out


def _gdn_weights(sd: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """A Gated DeltaNet layer's canonical weights: lin_in [Hd, 2 K + V | V | H | H] (q, k, v; z; b; a), the
    convolution's taps [taps, 2 K + V], A = -exp(A_log) and dt_bias [H], the gated norm's weight, o."""
    p, q = f"model.layers.{i}.linear_attn.", f"layers.{i}."
    proj = np.concatenate([sd[p + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")], axis=0)
    return {q + "lin_in.weight": proj.T.copy(), q + "o.weight": sd[p + "out_proj.weight"].T.copy(),
            q + "lin_conv.weight": np.ascontiguousarray(sd[p + "conv1d.weight"][:, 0, :].T),
            q + "lin_A": -np.exp(sd[p + "A_log"].astype(np.float32)), q + "lin_dt_bias": sd[p + "dt_bias"],
            q + "lin_norm.weight": sd[p + "norm.weight"]}


def _conv_weights(sd: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """A "conv" layer's canonical weights: conv_in [Hd, 3 Hd] (B, C, x), the taps [taps, Hd], o [Hd, Hd]."""
    p, q = f"model.layers.{i}.conv.", f"layers.{i}."
    out = {q + "conv_in.weight": sd[p + "in_proj.weight"].T.copy(), q + "o.weight": sd[p + "out_proj.weight"].T.copy(),
           q + "conv.weight": np.ascontiguousarray(sd[p + "conv.weight"][:, 0, :].T)}
    for theirs, ours in (("in_proj", "conv_in"), ("out_proj", "o"), ("conv", "conv")):
        if p + theirs + ".bias" in sd:
            out[q + ours + ".bias"] = sd[p + theirs + ".bias"]
    return out


def _mamba(config: Any, kinds: list[str], heads: int, head_dim: int, state: int, groups: int, taps: int,
           activation: str) -> dict[str, Any]:
    """A Mamba-2 mixer's spec fields (manifest.ModelSpec.mamba_*) and the layers' types: `kinds` per layer, "mamba"
    for a mixer's. Its convolution's activation must be SiLU, and time_step_limit (0, inf): transformers clamps dt
    to it in a prompt's chunked scan but not in a decode step, so a finite limit has no one answer to be faithful
    to."""
    if str(_get(config, activation, "silu")) != "silu":  # (activation: the config's name for it)
        _refuse(activation, _get(config, activation), "the Mamba-2 convolution is built with SiLU")
    low, high = (float(x) for x in (_get(config, "time_step_limit", None) or (0.0, float("inf"))))
    if low != 0.0 or high != float("inf"):
        _refuse("time_step_limit", (low, high), "transformers clamps dt in a prompt's scan but not in a decode step, "
                "so the two disagree; llmc builds (0, inf)")
    if heads % groups:
        _refuse("n_groups", groups, f"the Mamba-2 heads ({heads}) must be a multiple of the groups")
    return {"layer_types": tuple(kinds), "mamba_heads": heads, "mamba_head_dim": head_dim, "mamba_state": state,
            "mamba_groups": groups, "mamba_conv_kernel": taps}


def _granite_hybrid(config: Any) -> dict[str, Any]:
    """Granite 4.0-H: Mamba-2 layers ("mamba" in its layer_types, or "linear_attention" as transformers renames it)
    among attention layers, Granite's multipliers, rotary only where position_embedding_type is "rope", a mixture
    beside the shared MLP where num_local_experts > 0 (else the shared MLP is the layer's dense one)."""
    kinds = ["mamba" if t in ("mamba", "linear_attention") else "full_attention" for t in config.layer_types]
    fields = {**_granite(config), **_mamba(config, kinds, int(config.mamba_n_heads), int(config.mamba_d_head),
                                             int(config.mamba_d_state), int(config.mamba_n_groups),
                                             int(config.mamba_d_conv), "hidden_act")}
    return {**fields, **_moe(config)} if int(config.num_local_experts) else fields


def _granite_hybrid_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Granite 4.0-H's mixture under Mixtral's names and its shared MLP as the shared experts, or, without experts,
    as the layer's dense MLP."""
    sd = _granite_shared_names(_renamed(sd, _GRANITEMOE_NAMES))
    return sd if int(config.num_local_experts) else _renamed(sd, ((".mlp.shared_experts.", ".mlp."),))


def _bamba(config: Any) -> dict[str, Any]:
    """Bamba: Mamba-2 layers, attention at attn_layer_indices (half its head rotated), a SwiGLU MLP in every layer."""
    kinds = ["full_attention" if t == "full_attention" else "mamba" for t in config.layers_block_type]
    return _mamba(config, kinds, int(config.mamba_n_heads), int(config.mamba_d_head), int(config.mamba_d_state),
                  int(config.mamba_n_groups), int(config.mamba_d_conv), "hidden_act")


_BAMBA_NAMES = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
                ("model.final_layernorm.", "model.norm."))


def _falcon_h1(config: Any) -> dict[str, Any]:
    """Falcon-H1: in every layer attention and a Mamba-2 mixer read the same normed input and their outputs are added
    ("hybrid" layers), then a SwiGLU MLP; the mixer's gated RMSNorm only where mamba_rms_norm (normed before or after
    the gate: mamba_norm_before_gate); its muP multipliers folded into the weights (_falcon_h1_names) but the
    embeddings' and the head's."""
    heads = int(config.mamba_n_heads)
    fields = _mamba(config, ["hybrid"] * int(config.num_hidden_layers), heads, int(config.mamba_d_head),
                    int(config.mamba_d_state), int(config.mamba_n_groups), int(config.mamba_d_conv), "hidden_act")
    norm = ("none" if not config.mamba_rms_norm else "before_gate" if config.mamba_norm_before_gate
            else "after_gate")
    return {**fields, "mamba_norm": norm, "embedding_scale": float(config.embedding_multiplier),
            "logits_scaling": 1.0 / float(config.lm_head_multiplier)}


def _falcon_h1_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Falcon-H1's weights under Bamba's names, its multipliers folded in: the attention's input multiplier into
    q, k and v, the key multiplier into k (and its bias), the output multiplier into o; the mixer's input multiplier
    and its muP vector (per section of z, x, B, C, dt) into in_proj's rows (the vector into its bias too), the
    output multiplier into out_proj; the MLP's gate and down multipliers into gate_proj and down_proj."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    out = _renamed(sd, _BAMBA_NAMES)
    mup = compute_mup_vector(config).reshape(-1).numpy().astype(np.float32)
    attn_in, key = float(config.attention_in_multiplier), float(config.key_multiplier)
    gate, down = (float(x) for x in config.mlp_multipliers)

    def scaled(name: str, weight: float | np.ndarray, bias: float | np.ndarray | None) -> None:
        out[name + ".weight"] = (out[name + ".weight"] * np.reshape(weight, (-1, 1))).astype(np.float32)
        if bias is not None and name + ".bias" in out:
            out[name + ".bias"] = (out[name + ".bias"] * bias).astype(np.float32)

    for i in range(int(config.num_hidden_layers)):
        p = f"model.layers.{i}."
        scaled(p + "self_attn.q_proj", attn_in, None)
        scaled(p + "self_attn.k_proj", attn_in * key, key)
        scaled(p + "self_attn.v_proj", attn_in, None)
        scaled(p + "self_attn.o_proj", float(config.attention_out_multiplier), float(config.attention_out_multiplier))
        scaled(p + "mamba.in_proj", mup * float(config.ssm_in_multiplier), mup)
        scaled(p + "mamba.out_proj", float(config.ssm_out_multiplier), float(config.ssm_out_multiplier))
        scaled(p + "mlp.gate_proj", gate, gate)
        scaled(p + "mlp.down_proj", down, down)
    return out


def _kimi_linear(config: Any) -> dict[str, Any]:
    """Kimi Linear: Kimi Delta Attention layers ("linear_attention": the Gated DeltaNet's rule with a decay per key
    dim, linear_kind "kda") among latent-attention layers without positions (its model has no rotary: the rotated
    part of each key is not rotated), DeepSeek-V3's mixture where mlp_layer_types says sparse."""
    heads, dim = int(config.linear_num_heads), int(config.linear_head_dim)
    return {**_moe(config), "layer_types": tuple(config.layer_types), "linear_kind": "kda", "linear_k_heads": heads,
            "linear_v_heads": heads, "linear_k_dim": dim, "linear_v_dim": dim,
            "linear_conv_kernel": int(config.linear_conv_kernel_dim)}


def _kda_weights(sd: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """A Kimi Delta Attention layer's canonical weights: kda_in [Hd, 3 D | K | H | K] (q, k, v; the forget gate's
    f_a; b; the output gate's g_a), kda_f (f_b) and kda_g (g_b) [K, D], the convolution's taps [taps, 3 D],
    A = -exp(A_log) [H], dt_bias [D], the output norm's weight [K], o."""
    p, q = f"model.layers.{i}.self_attn.", f"layers.{i}."
    proj = np.concatenate([sd[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj",
                                                            "b_proj", "g_a_proj")], axis=0)
    return {q + "kda_in.weight": proj.T.copy(), q + "kda_f.weight": sd[p + "forget_gate.f_b_proj.weight"].T.copy(),
            q + "kda_g.weight": sd[p + "g_b_proj.weight"].T.copy(), q + "o.weight": sd[p + "o_proj.weight"].T.copy(),
            q + "lin_conv.weight": np.ascontiguousarray(sd[p + "conv1d.weight"][:, 0, :].T),
            q + "lin_A": -np.exp(sd[p + "forget_gate.A_log"].astype(np.float32).reshape(-1)),
            q + "lin_dt_bias": sd[p + "forget_gate.dt_bias"], q + "lin_norm.weight": sd[p + "o_norm.weight"]}


def _olmo_hybrid(config: Any) -> dict[str, Any]:
    """OLMo Hybrid: Gated DeltaNet layers normed before the mixer and the MLP, among OLMo 3's attention layers normed
    after them (a norm over all of q and of k; rotary only where rope_parameters has a rope_theta: its released
    models have none); beta doubled where linear_allow_neg_eigval, the output norm's epsilon 1e-5."""
    fields = _qwen3_5(config)
    types = tuple(config.layer_types)
    return {**fields, "attn_output_gate": False, "qk_norm": "full", "linear_norm_eps": 1e-5,
            "norm_layouts": tuple("pre" if t == "linear_attention" else "post" for t in types),
            "linear_beta_scale": 2.0 if config.linear_allow_neg_eigval else 1.0}


def _olmo_hybrid_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """OLMo Hybrid's Gated DeltaNet under Qwen3.5's names: q, k and v's products as in_proj_qkv, g_proj as in_proj_z,
    b_proj and a_proj as in_proj_b and in_proj_a, o_proj as out_proj, o_norm as norm."""
    out = dict(sd)
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}.linear_attn."
        if kind != "linear_attention":
            continue
        out[p + "in_proj_qkv.weight"] = np.concatenate([out.pop(p + f"{n}_proj.weight") for n in "qkv"], axis=0)
        for theirs, ours in (("g_proj", "in_proj_z"), ("b_proj", "in_proj_b"), ("a_proj", "in_proj_a"),
                             ("o_proj", "out_proj"), ("o_norm", "norm")):
            out[p + ours + ".weight"] = out.pop(p + theirs + ".weight")
    return out


def _mamba2(config: Any) -> dict[str, Any]:
    """Mamba-2 alone: every layer a Mamba-2 mixer after its RMSNorm, no MLP, no attention (so no KV cache: the
    engines hold only its states)."""
    layers = int(config.num_hidden_layers)
    fields = _mamba(config, ["mamba"] * layers, int(config.num_heads), int(config.head_dim), int(config.state_size),
                    int(config.n_groups), int(config.conv_kernel), "hidden_act")
    return {**fields, "mlp_layers": (False,) * layers, "norm_eps": float(config.layer_norm_epsilon)}


def _zamba_weights(spec: ModelSpec, sd: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """A Zamba2 hybrid layer's block weights: its shared block's (shared.{b}: the norm on [x, embeddings], qkv, o,
    the norm after attention, gate_up, down; the same arrays at every use of b), its adapters (qkv's: each of q, k,
    v's A stacked [2 hidden, 3 r] and their B block-diagonal [3 r, q k v]; gate_up's [hidden, r], [r, 2 I]) and its
    linear into the mixer's input."""
    s, p = f"model.layers.{i}.shared_transformer.", f"model.layers.{i}."
    b, q = f"shared.{spec.zamba_blocks[i]}.", f"layers.{i}."
    attn, ff = s + "self_attn.", s + "feed_forward."
    out = {b + "zamba_in.weight": sd[s + "input_layernorm.weight"], b + "zamba_mid.weight": sd[s + "pre_ff_layernorm.weight"],
           b + "qkv.weight": np.concatenate([sd[attn + f"{n}_proj.weight"] for n in "qkv"], axis=0).T.copy(),
           b + "o.weight": sd[attn + "o_proj.weight"].T.copy(), b + "gate_up.weight": sd[ff + "gate_up_proj.weight"].T.copy(),
           b + "down.weight": sd[ff + "down_proj.weight"].T.copy(), q + "zamba_linear.weight": sd[p + "linear.weight"].T.copy()}
    use = spec.layer_types[:i].count("zamba")  # (the adapters' index: this use's among the hybrid layers)
    qkv = [(attn + f"linear_{n}_adapter_list.{use}.0.weight", attn + f"linear_{n}_adapter_list.{use}.1.weight")
           for n in "qkv"]
    if all(a in sd for a, _ in qkv):
        out[q + "qkv_adapter_a.weight"] = np.concatenate([sd[a] for a, _ in qkv], axis=0).T.copy()
        ups = [sd[up].T for _, up in qkv]  # [r, out] each
        block = np.zeros((sum(u.shape[0] for u in ups), sum(u.shape[1] for u in ups)), np.float32)
        row = col = 0
        for u in ups:
            block[row:row + u.shape[0], col:col + u.shape[1]] = u
            row, col = row + u.shape[0], col + u.shape[1]
        out[q + "qkv_adapter_b.weight"] = block
    a, up = ff + f"gate_up_proj_adapter_list.{use}.0.weight", ff + f"gate_up_proj_adapter_list.{use}.1.weight"
    if a in sd:
        out[q + "gate_up_adapter_a.weight"], out[q + "gate_up_adapter_b.weight"] = sd[a].T.copy(), sd[up].T.copy()
    return out


def _zamba2(config: Any) -> dict[str, Any]:
    """Zamba2: a Mamba-2 mixer in every layer (no MLP after it); on its "hybrid" layers ("zamba"), first one of
    num_mem_blocks shared attention blocks on [x, the embeddings] (2 x hidden wide, heads of 2 x hidden / heads,
    scores scaled by (head dim / 2)^-0.5, rotary where use_mem_rope; its MLP; the layer's own adapters), through the
    layer's own linear into the mixer's input; dt at least time_step_min (as its trained scan clamps it), the gated
    norm at its fixed 1e-5."""
    types = list(config.layers_block_type)
    if unknown := sorted(set(types) - {"linear_attention", "mamba", "hybrid"}):
        _refuse("layers_block_type", unknown, "llmc builds Zamba2's mamba and hybrid layers")
    if _get(config, "add_bias_linear", False):
        _refuse("add_bias_linear", True, "a Zamba2 block's MLP biases are not implemented")
    kinds = ["zamba" if t == "hybrid" else "mamba" for t in types]
    heads = int(config.n_mamba_heads)
    fields = _mamba(config, kinds, heads, int(config.mamba_headdim), int(config.mamba_d_state),
                    int(config.mamba_ngroups), int(config.mamba_d_conv), "mamba_hidden_act")
    blocks, uses = [], 0
    for t in types:  # (transformers' tie order: the hybrid layers take the num_mem_blocks blocks in turn)
        blocks.append(uses % int(config.num_mem_blocks) if t == "hybrid" else -1)
        uses += t == "hybrid"
    return {**fields, "mlp_layers": (False,) * len(types), "mamba_norm_eps": 1e-5,
            "mamba_dt_min": float(config.time_step_min), "zamba_blocks": tuple(blocks),
            "attention_scale": (int(config.attention_head_dim) / 2) ** -0.5}


def _zamba2_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Zamba2's weights under the names the others use: a hybrid layer's mixer and its norm as a mamba layer's
    (mamba, input_layernorm); its shared block, adapters and linear stay as they are (_zamba_weights)."""
    return _renamed(sd, ((".mamba_decoder.", "."), ("model.final_layernorm.", "model.norm.")))


def _mamba2_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Mamba-2's weights under the names the others use: each block's norm as input_layernorm, its mixer as mamba."""
    out = _renamed(sd, (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
                        ("backbone.layers.", "model.layers."), (".mixer.", ".mamba.")))
    return {re.sub(r"^(model\.layers\.\d+)\.norm\.", r"\1.input_layernorm.", k): v for k, v in out.items()}


def _nemotron_h(config: Any) -> dict[str, Any]:
    """Nemotron-H: one mixer or MLP a block, each after its own RMSNorm: Mamba-2 ("linear_attention"), attention
    without positions ("full_attention") or a plain squared-ReLU MLP ("mlp"): llmc layers of those types, the
    mixers' without an MLP (ModelSpec.mlp_layers); its mixture blocks ("moe") are "mlp" layers whose MLP is a
    mixture: DeepSeek-V3's router over ungated squared-ReLU experts (on a latent projection of the hidden state where
    moe_latent_size says: ModelSpec.moe_latent_size), a plain shared expert beside them."""
    types = list(config.layers_block_type)
    kinds = {"linear_attention": "mamba", "full_attention": "full_attention", "mlp": "mlp", "moe": "mlp"}
    if unknown := sorted(set(types) - set(kinds)):
        _refuse("layers_block_type", unknown, f"llmc builds {', '.join(kinds)} blocks")
    fields = _mamba(config, [kinds[t] for t in types], int(config.mamba_num_heads), int(config.mamba_head_dim),
                    int(config.ssm_state_size), int(config.n_groups), int(config.conv_kernel),
                    "mamba_hidden_act")
    latent = int(_get(config, "moe_latent_size", 0) or 0) if "moe" in types else 0
    return {**fields, **(_moe(config) if "moe" in types else {}), **({"moe_latent_size": latent} if latent else {}),
            "mlp_layers": tuple(t in ("mlp", "moe") for t in types), "plain_mlp": True,
            "activation": _activation(str(config.mlp_hidden_act)), "norm_eps": float(config.layer_norm_epsilon),
            "intermediate_size": int(config.intermediate_size)}


def _nemotron_h_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Nemotron-H's blocks under the layer names the others use: each block's norm as input_layernorm, its mixer as
    mamba, self_attn or the plain MLP (up_proj, down_proj as c_fc, c_proj)."""
    out = _renamed(sd, (("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm."),
                        ("backbone.", "model.")))
    parts = {"linear_attention": ".mamba.", "full_attention": ".self_attn.", "mlp": ".mlp.", "moe": ".mlp."}
    renamed: dict[str, np.ndarray] = {}
    for k, v in out.items():
        if k.startswith("model.layers."):
            i = int(k.split(".")[2])
            k = k.replace(f"model.layers.{i}.norm.", f"model.layers.{i}.input_layernorm.")
            part = parts.get(config.layers_block_type[i], ".mixer.")  # (a block llmc refuses: as it is)
            k = k.replace(f"model.layers.{i}.mixer.", f"model.layers.{i}{part}")
            k = k.replace(".mlp.up_proj.", ".mlp.c_fc.").replace(".mlp.down_proj.", ".mlp.c_proj.")
        renamed[k] = v
    return renamed


MAMBA1_ALONE = ("mamba", "falcon_mamba")  # (Mamba-1 mixers alone: no attention, no MLP)


def scan_heads(channels: int) -> tuple[int, int]:
    """Mamba-1's channels as (heads, head dim) for the operator: heads of up to 64 channels (each head one pool
    task, its state [N, 64] in the core's cache), every channel its own recurrence either way."""
    width = next(w for w in range(min(64, channels), 0, -1) if channels % w == 0)
    return channels // width, width


def _mamba1(config: Any, kinds: list[str], channels: int, state: int, taps: int, rank: int,
            activation: str) -> dict[str, Any]:
    """A Mamba-1 mixer's spec fields (ModelSpec.mamba_version 1) and the layers' types ("mamba" for a mixer's)."""
    if str(_get(config, activation, "silu")) != "silu":
        _refuse(activation, _get(config, activation), "the Mamba-1 convolution is built with SiLU")
    heads, width = scan_heads(channels)
    return {"layer_types": tuple(kinds), "mamba_version": 1, "mamba_heads": heads, "mamba_head_dim": width,
            "mamba_state": state, "mamba_conv_kernel": taps, "mamba_dt_rank": rank}


def _mamba_alone(config: Any) -> dict[str, Any]:
    """Mamba and Falcon Mamba: every layer a Mamba-1 mixer after its RMSNorm, no MLP, no attention (no KV cache);
    Falcon Mamba's dt, B and C RMS-normed without weights (mixer_rms_eps)."""
    layers = int(config.num_hidden_layers)
    fields = _mamba1(config, ["mamba"] * layers, int(config.expand) * int(config.hidden_size), int(config.state_size),
                     int(config.conv_kernel), int(config.time_step_rank), "hidden_act")
    if config.model_type == "falcon_mamba":
        fields.update(mamba_bcdt_norm=True, mamba_norm_eps=float(config.mixer_rms_eps))
    return {**fields, "mlp_layers": (False,) * layers, "norm_eps": float(config.layer_norm_epsilon)}


def _falcon_mamba_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Falcon Mamba's weights as Mamba's, its weightless norms of dt, B and C given weights of ones."""
    out = _mamba2_names(config, sd)
    rank, state = int(config.time_step_rank), int(config.state_size)
    for i in range(int(config.num_hidden_layers)):
        for name, width in (("dt", rank), ("b", state), ("c", state)):
            out[f"model.layers.{i}.mamba.{name}_layernorm.weight"] = np.ones(width, np.float32)
    return out


def _jamba(config: Any) -> dict[str, Any]:
    """Jamba: Mamba-1 layers (dt, B and C RMS-normed) and, every attn_layer_period-th from attn_layer_offset,
    attention without positions; then a SwiGLU MLP, or on every expert_layer_period-th layer a mixture (a softmax
    over the experts, the top k's weights as they are)."""
    kinds = ["full_attention" if t == "attention" else "mamba" for t in config.layers_block_type]
    fields = _mamba1(config, kinds, int(config.mamba_expand) * int(config.hidden_size), int(config.mamba_d_state),
                     int(config.mamba_d_conv), int(config.mamba_dt_rank), "hidden_act")
    fields["mamba_bcdt_norm"] = True
    return {**fields, **(_moe(config) if int(config.num_experts) > 1 else {})}


_JAMBA_NAMES = (*_BAMBA_NAMES, (".mlp.router.", ".mlp.gate."))


def _mamba_weights(spec: ModelSpec, sd: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """A Mamba mixer's canonical weights: mamba_in, the convolution's taps [taps, channels] and its bias, mamba_out
    (and their biases where the model has them), then its version's own (_mamba2_own, _mamba1_own)."""
    p, q = f"model.layers.{i}.mamba.", f"layers.{i}."
    out = {q + "mamba_in.weight": sd[p + "in_proj.weight"].T.copy(),
           q + "mamba_out.weight": sd[p + "out_proj.weight"].T.copy(),
           q + "mamba_conv.weight": np.ascontiguousarray(sd[p + "conv1d.weight"][:, 0, :].T)}
    for theirs, ours in (("in_proj", "mamba_in"), ("out_proj", "mamba_out"), ("conv1d", "mamba_conv")):
        if p + theirs + ".bias" in sd:
            out[q + ours + ".bias"] = sd[p + theirs + ".bias"]
    return {**out, **(_mamba1_own(spec, sd, p, q) if spec.mamba_version == 1 else _mamba2_own(sd, p, q))}


def _mamba2_own(sd: dict[str, np.ndarray], p: str, q: str) -> dict[str, np.ndarray]:
    """A Mamba-2 mixer's (mamba_in [Hd, inner | x, B, C | heads]: z, the convolved channels, dt): A = -exp(A_log),
    dt_bias and D [heads], the gated norm's weight (where the model has one)."""
    out = {q + "mamba_A": -np.exp(sd[p + "A_log"].astype(np.float32)), q + "mamba_dt_bias": sd[p + "dt_bias"],
           q + "mamba_D": sd[p + "D"]}
    if p + "norm.weight" in sd:
        out[q + "mamba_norm.weight"] = sd[p + "norm.weight"]
    return out


def _mamba1_own(spec: ModelSpec, sd: dict[str, np.ndarray], p: str, q: str) -> dict[str, np.ndarray]:
    """A Mamba-1 mixer's (mamba_in [Hd, 2 C]: x, z): mamba_x [C, rank + 2 N] (dt; B; C) and dt, B and C's norms
    (where the model norms them), mamba_dt [rank, C] and its bias, A = -exp(A_log) as [H, N, P] and D as [H, P] (the
    channels in the spec's heads)."""
    heads, width, state = spec.mamba_heads, spec.mamba_head_dim, spec.mamba_state
    a = -np.exp(sd[p + "A_log"].astype(np.float32))  # [C, N]
    out = {q + "mamba_x.weight": sd[p + "x_proj.weight"].T.copy(), q + "mamba_dt.weight": sd[p + "dt_proj.weight"].T.copy(),
           q + "mamba_dt.bias": sd[p + "dt_proj.bias"],
           q + "mamba_A": np.ascontiguousarray(a.reshape(heads, width, state).transpose(0, 2, 1)),
           q + "mamba_D": sd[p + "D"].reshape(heads, width)}
    if spec.mamba_bcdt_norm:
        for name in ("dt", "b", "c"):
            out[q + f"mamba_{name}_norm.weight"] = sd[p + f"{name}_layernorm.weight"]
    return out


def _llama4(config: Any) -> dict[str, Any]:
    """Llama 4 (text): interleaved rotary (reordered at export) on the layers no_rope_layers marks, a weightless
    qk-norm on those only, mixtures on config.moe_layers (the top k logits' sigmoids scale the experts' inputs, a
    shared expert added). Its rotated layers attend in chunks (a query sees the keys of its own attention_chunk_size
    block), and its layers without rotary scale their queries by 1 + attn_scale log1p(floor((pos + 1) /
    floor_scale))."""
    rope = tuple(bool(r) for r in config.no_rope_layers)
    chunk = int(_get(config, "attention_chunk_size", 0) or 0)
    fields: dict[str, Any] = {**_moe(config), "rope_layers": rope,
                              **({"qk_norm": "head", "qk_norm_layers": rope} if config.use_qk_norm else {})}
    if 0 < chunk < int(config.max_position_embeddings):  # (a chunk as long as every row: full attention)
        fields.update(attention_chunk=chunk,
                      layer_types=tuple("chunked_attention" if r else "full_attention" for r in rope))
    if _get(config, "attn_temperature_tuning", False) and not all(rope):
        fields.update(query_scale_beta=float(config.attn_scale), query_scale_after=int(config.floor_scale),
                      query_scale_offset=1, query_scale_nope_only=True)
    return fields


def _llama4_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Llama 4's weights under the names the others use: its experts ([E, hidden, 2I] and [E, I, hidden]: llmc's
    canonical layout) as transformers' other families hold them, its weightless qk-norms as weights of 1."""
    from llmc.graph.moe import is_sparse_layer

    out = _interleaved_to_halves(config, _renamed(sd, ((".feed_forward.shared_expert.", ".mlp.shared_experts."),
                                                       (".feed_forward.router.", ".mlp.gate."),
                                                       (".feed_forward.", ".mlp."))))
    head_dim = int(_get(config, "head_dim", config.hidden_size // config.num_attention_heads))
    for i in range(int(config.num_hidden_layers)):
        p = f"model.layers.{i}."
        if config.use_qk_norm and config.no_rope_layers[i]:
            out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = np.ones(head_dim, np.float32)
        if is_sparse_layer(config, i):
            e = p + "mlp.experts."
            out[e + "gate_up_proj"] = out[e + "gate_up_proj"].transpose(0, 2, 1)
            out[e + "down_proj"] = out[e + "down_proj"].transpose(0, 2, 1)
    return out


def _laguna(config: Any) -> dict[str, Any]:
    """Laguna: qk-norm per head, sliding / full layers (the full ones rotating part of each head:
    _partial_rotary_halves), the attention's output times softplus(h @ g_proj) per head or per element, GLM-4.5's
    sigmoid routing (one group) with a correction bias, renormalized, times moe_routed_scaling_factor, a shared expert
    added, dense layers by mlp_layer_types."""
    per_layer = set(_get(config, "num_attention_heads_per_layer", None) or [config.num_attention_heads])
    if len(per_layer) > 1:
        _refuse("num_attention_heads_per_layer", sorted(per_layer), "one head count per model")
    if float(_get(config, "moe_router_logit_softcapping", 0.0)):
        _refuse("moe_router_logit_softcapping", config.moe_router_logit_softcapping, "llmc does not implement it")
    return {**_moe(config), "num_heads": per_layer.pop(), "qk_norm": "head", "attn_output_gate": True,
            "attn_gate_activation": "softplus"}


def _laguna_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Laguna's output gate g_proj ([heads, hidden] per head: each row repeated over its head's dims) as the
    per-element gate AFMoE's gate_proj is."""
    head_dim = int(config.head_dim)
    out = dict(sd)
    for name in [k for k in sd if k.endswith("self_attn.g_proj.weight")]:
        gate = out.pop(name)
        per_head = gate.shape[0] * head_dim == sd[name.replace("g_proj", "q_proj")].shape[0]  # (else per element)
        out[name.replace("g_proj", "gate_proj")] = np.repeat(gate, head_dim, axis=0) if per_head else gate
    return out


def _mimo_v2_flash(config: Any) -> dict[str, Any]:
    """MiMo-V2-Flash: sliding layers with twice the full layers' KV heads and a sink per head, values narrower than
    q / k and scaled, partial rotary with a base per layer type, DeepSeek-V3's mixture without shared experts. Its
    layers are made one shape at export (_mimo_v2_flash_names): every layer has the sliding layers' KV heads, each
    head the q / k width, and a sink."""
    sliding = any(t == "sliding_attention" for t in config.layer_types)
    return {**_moe(config), "attn_sinks": True,
            "num_kv_heads": int(config.num_key_value_heads) * (2 if sliding else 1)}


def _mimo_v2_flash_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer at one shape, exactly: a full layer's KV heads repeated in place (each query head meets the same
    key and value), values times attention_value_scale padded with zero dims to the q / k width (o's input columns
    there zero: the output is unchanged), a full layer's sinks at the lowest float (exp(sink - max) is 0: no sink)."""
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    dim, v_dim = int(config.head_dim), int(config.v_head_dim)
    scale = np.float32(_get(config, "attention_value_scale", 1.0))
    sliding = any(t == "sliding_attention" for t in config.layer_types)
    out = dict(sd)

    def heads_of(w: np.ndarray, n: int, width: int, repeat: int, pad: int) -> np.ndarray:  # [n * width, ...]
        h = w.reshape(n, width, *w.shape[1:])
        if pad:
            h = np.concatenate([h, np.zeros((n, pad, *w.shape[1:]), w.dtype)], axis=1)
        return np.ascontiguousarray(np.repeat(h, repeat, axis=0).reshape(n * repeat * (width + pad), *w.shape[1:]))

    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}.self_attn."
        repeat = 2 if sliding and kind == "full_attention" else 1
        n = kv * (2 if kind == "sliding_attention" else 1)
        for part in ("weight", "bias"):
            if p + f"k_proj.{part}" in sd:
                out[p + f"k_proj.{part}"] = heads_of(sd[p + f"k_proj.{part}"], n, dim, repeat, 0)
            if p + f"v_proj.{part}" in sd:
                out[p + f"v_proj.{part}"] = heads_of(sd[p + f"v_proj.{part}"] * scale, n, v_dim, repeat, dim - v_dim)
        o = sd[p + "o_proj.weight"].reshape(-1, heads, v_dim)
        out[p + "o_proj.weight"] = np.ascontiguousarray(
            np.concatenate([o, np.zeros((o.shape[0], heads, dim - v_dim), o.dtype)], axis=2).reshape(o.shape[0], -1))
        if p + "sinks" not in sd:
            out[p + "sinks"] = np.full(heads, np.finfo(np.float32).min, np.float32)
    return out


def _hyperclovax(config: Any) -> dict[str, Any]:  # Granite's multipliers, logits multiplied; norms after the blocks
    multiplier = _get(config, "attention_multiplier", None)
    return {"embedding_scale": float(config.embedding_multiplier), "residual_scale": float(config.residual_multiplier),
            **({"attention_scale": float(multiplier)} if multiplier is not None else {}),
            "logits_scaling": 1.0 / float(config.logits_scaling),
            **({"norm_layout": "sandwich"} if _get(config, "use_post_norm", True) else {})}


# HyperCLOVA X's norms after attention and the MLP, and its norm before the MLP, under Gemma 2's names
_HYPERCLOVAX_NORMS = {"post_attention_layernorm": "pre_feedforward_layernorm", "post_norm1": "post_attention_layernorm",
                      "post_norm2": "post_feedforward_layernorm"}


def _layer_part_names(sd: dict[str, np.ndarray], names: dict[str, str]) -> dict[str, np.ndarray]:
    """Each `model.layers.i.<part>...` weight whose part `names` lists renamed once (no chains)."""
    out = {}
    for k, v in sd.items():
        parts = k.split(".")
        if len(parts) > 3 and parts[3] in names:
            parts[3] = names[parts[3]]
        out[".".join(parts)] = v
    return out


def _minicpm5_names(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """MiniCPM5-MoE's q_gate_proj [H * 2D, hidden] (each head's query rows, then its gate's) as q_proj and the
    attention's output gate (AFMoE's gate_proj)."""
    if _get(config, "attention_bias", False):
        _refuse("attention_bias", True, "the attention's output gate has no bias in llmc")
    heads, dim = int(config.num_attention_heads), int(config.head_dim)
    out = dict(sd)
    for name in [k for k in sd if k.endswith("self_attn.q_gate_proj.weight")]:
        w = out.pop(name).reshape(heads, 2, dim, -1)
        out[name.replace("q_gate_proj", "q_proj")] = np.ascontiguousarray(w[:, 0].reshape(heads * dim, -1))
        out[name.replace("q_gate_proj", "gate_proj")] = np.ascontiguousarray(w[:, 1].reshape(heads * dim, -1))
    return out


def _flint(config: Any) -> dict[str, Any]:
    """Flint: Qwen3-MoE's layer with a sink per head, RoPE on sliding layers only, sigmoid routing (no correction
    bias: zeros, _mlp_weights) and a shared expert added ungated."""
    rope = tuple(t == "sliding_attention" for t in config.layer_types)
    return {**_moe(config), "qk_norm": "head", "attn_sinks": True, **({"rope_layers": rope} if not all(rope) else {})}


def _moe(config: Any) -> dict[str, Any]:
    from llmc.graph.moe import is_sparse_layer, spec_from_hf_config

    try:
        moe = spec_from_hf_config(config)
    except ValueError as e:  # (a mixture the router cannot take, e.g. groups of one expert: one line, not a traceback)
        raise UnsupportedModelError(f"{config.model_type}'s mixture of experts is not supported: {e}") from None
    layers = tuple(is_sparse_layer(config, i) for i in range(config.num_hidden_layers))
    return {"num_experts": moe.num_experts, "experts_per_token": moe.experts_per_token,
            "moe_intermediate_size": moe.intermediate_size, "norm_topk_prob": moe.norm_topk_prob,
            "moe_activation": moe.activation, "swiglu_alpha": moe.alpha, "swiglu_limit": moe.limit,
            "moe_bias": moe.bias, "moe_routing": moe.routing, "moe_groups": moe.num_groups,
            "moe_topk_groups": moe.topk_groups, "routed_scaling": moe.routed_scaling,
            "moe_router_fp32": moe.router_fp32, "moe_jitter_eps": moe.jitter_eps, "moe_scale_inputs": moe.scale_inputs,
            "moe_norm_eps": moe.norm_eps,
            **({"moe_layers": layers} if not all(layers) else {}), **_shared_experts(config),
            **({"qk_norm": "head"} if config.model_type == "qwen3_moe" else {})}


def _shared_experts(config: Any) -> dict[str, Any]:
    """The experts every token runs beside its routed ones, as one MLP: Qwen2-MoE's (gated by a sigmoid), or
    GLM-4.5's / dots1's / ERNIE 4.5's (n experts of the routed ones' width) and Hunyuan's (of the dense width), added
    as they are."""
    if config.model_type in ("qwen2_moe", "qwen3_5_moe_text", "qwen3_next"):
        return {"shared_expert_size": int(config.shared_expert_intermediate_size)}
    if config.model_type == "nemotron_h":  # (one plain MLP of its own width, whatever n_shared_experts says)
        return {"shared_expert_size": int(config.moe_shared_expert_intermediate_size), "shared_expert_gated": False}
    if config.model_type in ("granitemoeshared", "granitemoe_swa", "granitemoehybrid"):
        width = int(_get(config, "shared_intermediate_size", 0))
        return {"shared_expert_size": width, "shared_expert_gated": False} if width else {}
    if config.model_type == "hunyuan_v1_moe":
        width = int(config.intermediate_size) * int(config.num_shared_expert)
    elif config.model_type in ("flint", "kolibri1", "kolibri1_1", "laguna", "lara_mini"):
        width = int(config.shared_expert_intermediate_size)
    elif config.model_type == "llama4_text":
        width = int(config.intermediate_size)
    elif config.model_type == "mimo_v2_flash":  # (none)
        width = 0
    elif config.model_type == "cohere2_moe":  # (its experts intermediate_size wide, the shared ones too)
        width = int(config.intermediate_size) * int(config.num_shared_experts)
    else:
        shared = int(_get(config, "n_shared_experts", 0) or _get(config, "moe_num_shared_experts", 0)
                     or _get(config, "num_shared_experts", 0))
        width = int(config.moe_intermediate_size) * shared if shared else 0
    return {"shared_expert_size": width, "shared_expert_gated": False} if width else {}


def _mla_rope_halves(config: Any, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """DeepSeek-V2 (always) and V3 / GLM-4.7-Flash (config.rope_interleave) rotate interleaved pairs of the rotated
    dims (the last qk_rope_head_dim of each query head and of kv_a_proj_with_mqa's output); their rows are
    reordered even then odd, as _interleaved_to_halves does for the other families."""
    if config.model_type == "minicpm3" or (config.model_type not in ("deepseek_v2", *SPARSE_INDEXED)
                                            and not _get(config, "rope_interleave", True)):
        return sd  # (MiniCPM3 rotates halves, as Llama)
    out = dict(sd)
    rope, heads = int(config.qk_rope_head_dim), int(config.num_attention_heads)
    halves = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    for i in range(int(config.num_hidden_layers)):
        attn = f"model.layers.{i}.self_attn."
        for name, n in (("q_proj", heads), ("q_b_proj", heads), ("kv_a_proj_with_mqa", 1)):
            for kind in ("weight", "bias"):
                key = attn + f"{name}.{kind}"
                if key not in out:
                    continue
                w = out[key].reshape(n, -1, *out[key].shape[1:])  # [heads, their dims, ...]: the rotated last
                keep = w.shape[1] - rope
                order = np.concatenate([np.arange(keep), keep + halves])
                out[key] = np.ascontiguousarray(w[:, order].reshape(out[key].shape))
    return out


# Per family: its weights under the names (and in the rotary layout) the others use, before anything reads them
_HUNYUAN_NAMES = ((".query_layernorm.", ".q_norm."), (".key_layernorm.", ".k_norm."), (".mlp.gate.wg.", ".mlp.gate."),
                  (".mlp.shared_mlp.", ".mlp.shared_experts."))
_PLAIN_MLP_NAMES = (("mlp.up_proj.", "mlp.c_fc."), ("mlp.down_proj.", "mlp.c_proj."))  # up, activation, down
_APERTUS_NAMES = (*_PLAIN_MLP_NAMES, (".attention_layernorm.", ".input_layernorm."),
                  (".feedforward_layernorm.", ".post_attention_layernorm."))
_GRANITEMOE_NAMES = ((".block_sparse_moe.router.", ".mlp.gate."), (".block_sparse_moe.experts.", ".mlp.experts."))
_BLOCK_CORRECTION_BIAS = ((".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),)  # (MiniMax-M2, Hy3)
_WEIGHT_NAMES: dict[str, Callable[[Any, dict[str, np.ndarray]], dict[str, np.ndarray]]] = {
    "gemma4_text": _gemma4_names,
    "phi": lambda c, sd: _renamed(sd, _PHI_NAMES), "gpt_neox": _gpt_neox_names, "olmo": _norm_params,
    "falcon": _falcon_names,
    "minimax_m2": lambda c, sd: _renamed(sd, _BLOCK_CORRECTION_BIAS),
    "afmoe": lambda c, sd: _renamed(sd, _AFMOE_NAMES),
    "gptj": lambda c, sd: _interleaved_to_halves(c, _renamed(sd, _GPTJ_NAMES), _gptj_rotated(c)),
    "nemotron": lambda c, sd: _renamed(sd, _PLAIN_MLP_NAMES), "arcee": lambda c, sd: _renamed(sd, _PLAIN_MLP_NAMES),
    "apertus": lambda c, sd: _renamed(sd, _APERTUS_NAMES),
    "apertus1p5_text": lambda c, sd: _renamed(sd, _APERTUS_NAMES),  # (Apertus's layers under their names)
    "granitemoe": lambda c, sd: _renamed(sd, _GRANITEMOE_NAMES),  # its mixture under Mixtral's names
    "granitemoeshared": lambda c, sd: _granite_shared_names(_renamed(sd, _GRANITEMOE_NAMES)),
    "granitemoe_swa": lambda c, sd: _granite_shared_names(_renamed(sd, _GRANITEMOE_NAMES)),
    "hyperclovax": lambda c, sd: _layer_part_names(sd, _HYPERCLOVAX_NORMS), "jais2": lambda c, sd: _renamed(
        sd, _PLAIN_MLP_NAMES), "minicpm5_moe": _minicpm5_names,
    "flint": lambda c, sd: _renamed(sd, ((".mlp.shared_expert.", ".mlp.shared_experts."),)),
    "lara_mini": lambda c, sd: _renamed(sd, ((".mlp.shared_expert.", ".mlp.shared_experts."),)),
    "kolibri1": lambda c, sd: _layer_part_names(sd, _GLM4_NORMS), "dbrx": _dbrx_names,
    "jetmoe": lambda c, sd: _renamed(sd, _JETMOE_NAMES),
    "kolibri1_1": lambda c, sd: _layer_part_names(sd, _GLM4_NORMS),
    "cohere2_moe": _cohere2_moe_names, "phimoe": lambda c, sd: _renamed(sd, ((".mlp.router.", ".mlp.gate."),)),
    "llama4_text": _llama4_names, "lfm2": lambda c, sd: _renamed(sd, _LFM2_NAMES),
    "lfm2_moe": lambda c, sd: _renamed(sd, _LFM2_NAMES), "lfm3": _lfm3_names,
    "qwen3_5_text": _qwen3_5_names, "qwen3_5_moe_text": _qwen3_5_names,
    "qwen3_next": lambda c, sd: _qwen3_5_names(c, _qwen3_next_names(c, sd)),
    "granitemoehybrid": _granite_hybrid_names, "bamba": lambda c, sd: _renamed(sd, _BAMBA_NAMES),
    "nemotron_h": _nemotron_h_names, "falcon_h1": _falcon_h1_names, "olmo_hybrid": _olmo_hybrid_names,
    "mamba2": _mamba2_names, "mamba": _mamba2_names, "zamba2": _zamba2_names, "falcon_mamba": _falcon_mamba_names,
    "jamba": lambda c, sd: _renamed(sd, _JAMBA_NAMES),
    "mimo_v2_flash": _mimo_v2_flash_names, "laguna": _laguna_names,
    "hy_v3": lambda c, sd: _renamed(sd, _BLOCK_CORRECTION_BIAS),
    "vaultgemma": lambda c, sd: _renamed(sd, ((".pre_feedforward_layernorm.", ".post_attention_layernorm."),)),
    "nanochat": lambda c, sd: _nanochat_names(c, sd),
    "helium": _interleaved_to_halves, "ernie4_5": _interleaved_to_halves,
    "ernie4_5_moe": _interleaved_to_halves,
    "hunyuan_v1_dense": lambda c, sd: _renamed(sd, _HUNYUAN_NAMES),
    "hunyuan_v1_moe": lambda c, sd: _renamed(sd, _HUNYUAN_NAMES), "glm": _glm_names, "glm4": _glm_names,
    **{mt: _mla_rope_halves for mt in MLA},
    "cohere": lambda c, sd: _interleaved_to_halves(c, _norm_params(c, sd)),
    "cohere2": lambda c, sd: _interleaved_to_halves(c, _norm_params(c, sd)),
}

_QUIRKS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "gemma4_text": _gemma4, "qwen3": _qwen3, "phi": _phi, "gemma": _gemma, "gemma2": _gemma, "gemma3_text": _gemma, "smollm3": _smollm3,
    "cohere": _cohere, "cohere2": _cohere2, "nemotron": _nemotron, "arcee": _arcee, "apertus": _apertus,
    "bitnet": _bitnet,
    "apertus1p5_text": _apertus,
    "exaone4": _exaone4,
    "glm": _glm, "glm4": _glm,
    "olmo": _olmo, "stablelm": _stablelm, "gpt_neox": _gpt_neox, "falcon": _falcon, "gptj": _gptj,
    "starcoder2": _starcoder2,
    "olmo2": _olmo2,
    "olmo3": _olmo2,
    "granite": _granite, "granitemoe": lambda c: {**_granite(c), **_moe(c)},
    "granitemoeshared": lambda c: {**_granite(c), **_moe(c)}, "vaultgemma": _gemma, "solar_open": _moe,
    "nanochat": lambda c: {"plain_mlp": True, "qk_norm": "head", "embed_norm": True,
                           "final_softcap": float(_get(c, "final_logit_softcapping", 0.0))},
    "mixtral": _moe, "qwen2_moe": _moe,
    "qwen3_moe": _moe, "gpt_oss": lambda c: {**_moe(c), "attn_sinks": True},
    "glm4_moe": lambda c: {**_moe(c), **({"qk_norm": "head"} if c.use_qk_norm else {})},
    "dots1": lambda c: {**_moe(c), "qk_norm": "head"},
    **{mt: _moe for mt in MLA if mt not in MLA_DENSE},  # (their attention: _mla)
    "minicpm3": lambda c: {"embedding_scale": float(c.scale_emb), "logits_scaling": float(c.logits_scaling),
                           "residual_scale": float(c.scale_depth) / float(c.num_hidden_layers) ** 0.5},
    "minimax_m2": lambda c: {**_moe(c), "qk_norm": "full"}, "ministral3": _ministral3, "afmoe": _afmoe,
    "flex_olmo": lambda c: {**_moe(c), "norm_layout": "post", "qk_norm": "full"},  # (OLMo 2's layer, OLMoE's MoE)
    "exaone_moe": _exaone_moe,
    "granite_swa": _granite_swa, "granitemoe_swa": lambda c: {**_granite_swa(c), **_moe(c)},
    "hyperclovax": _hyperclovax, "jais2": lambda c: {"norm": "layer", "norm_eps": float(c.layer_norm_eps),
                                                     "plain_mlp": True},
    "minicpm5_moe": lambda c: {**_moe(c), "attn_output_gate": True}, "mellum": lambda c: {**_moe(c), "qk_norm": "head"},
    "flint": _flint, "hy_v3": lambda c: {**_moe(c), "qk_norm": "head"},
    "dbrx": _dbrx, "cohere2_moe": _cohere2_moe,
    "phimoe": lambda c: {"norm": "layer", "norm_eps": float(c.rms_norm_eps), **_moe(c)},
    "mimo_v2_flash": _mimo_v2_flash, "laguna": _laguna, "llama4_text": _llama4, "lfm2": _lfm2,
    "lfm2_moe": lambda c: {**_lfm2(c), **_moe(c)}, "lfm3": _lfm2,
    "qwen3_5_text": _qwen3_5, "qwen3_5_moe_text": lambda c: {**_qwen3_5(c), **_moe(c)},
    "qwen3_next": lambda c: {**_qwen3_5(c), **_moe(c)},
    "granitemoehybrid": _granite_hybrid, "bamba": _bamba, "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1,
    "kimi_linear": _kimi_linear, "olmo_hybrid": _olmo_hybrid, "mamba2": _mamba2,
    "mamba": _mamba_alone, "falcon_mamba": _mamba_alone, "jamba": _jamba, "zamba2": _zamba2,
    "lara_mini": lambda c: {**_qwen3_5(c), **_moe(c), "attn_output_gate": False,  # (its attention ungated,
                            "rope_layers": tuple(t == "sliding_attention" for t in c.layer_types)},  # RoPE on sliding
    # layers only)
    "axk1": lambda c: {**_moe(c), "moe_post_norm": True},  # (DeepSeek-V3, the mixture normed)
    **{mt: lambda c: {**_moe(c), "max_positions": min(int(c.max_position_embeddings), int(c.index_topk))}
       for mt in SPARSE_INDEXED},  # (LayerNorm with bias)
    # (Kolibri-1: EXAONE 4's attention, GLM-4's norms)
    "kolibri1": lambda c: {**_moe(c), **_exaone4(c), "norm_layout": "sandwich"},
    "kolibri1_1": lambda c: {**_moe(c), **_exaone4(c), "norm_layout": "sandwich", **_kolibri1_1(c)},
    "jetmoe": lambda c: {**_moe(c), "moa_experts": int(c.num_local_experts), "moa_top_k": int(c.num_experts_per_tok)},
    "olmoe": lambda c: {**_moe(c), "qk_norm": "full", **_clip_qkv(c)}, "ernie4_5_moe": _moe,
    "hunyuan_v1_dense": lambda c: {"qk_norm": "head", "qk_norm_after_rope": True},
    "hunyuan_v1_moe": lambda c: {**_moe(_uniform(c, "num_experts", "moe_topk", "num_shared_expert")),
                                 "qk_norm": "head", "qk_norm_after_rope": True},
}


def _decoder_weights(spec: ModelSpec, sd: dict[str, np.ndarray], fold_norm_offset: bool,
                     release: LayerRelease | None = None) -> dict[str, np.ndarray]:
    """Canonical weights of a RoPE decoder; `fold_norm_offset`: the checkpoint's norms multiply by 1 + w (Gemma);
    `release`: transformers' copy of each layer's products let go once the layer's own are made."""
    def norm(name: str) -> np.ndarray:
        return sd[name] + np.float32(1.0) if fold_norm_offset else sd[name]

    def bias(theirs: str, ours: str) -> None:  # a LayerNorm's or a linear layer's bias, where the model has one
        if theirs + ".bias" in sd:
            w[ours + ".bias"] = sd[theirs + ".bias"]

    w: dict[str, np.ndarray] = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": norm("model.norm.weight")}
    if spec.embed_norm:
        w["embed_norm.weight"] = sd["embed_norm.weight"]
    bias("model.norm", "norm")
    if not spec.tie_embeddings:
        w["lm_head.weight"] = sd["lm_head.weight"]
    bias("lm_head", "lm_head")  # Phi-2
    # the norms by where they sit: before attention, before the MLP, after attention, after the MLP
    places = {"pre": {"input_layernorm": "norm1", "post_attention_layernorm": "norm2"},
              "sandwich": {"input_layernorm": "norm1", "pre_feedforward_layernorm": "norm2",
                           "post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm"},
              "post": {"post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm"}}
    for i in _each_layer(spec.num_layers, w, release):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        one_block = not (spec.has_mixer(i) and spec.has_mlp(i))  # (Nemotron-H's) a mixer or an MLP, on norm1
        for theirs, ours in places[spec.layout(i)].items():
            if (spec.parallel_block == "shared" or one_block) and ours == "norm2":
                continue  # the block's one norm serves both
            w[q + ours + ".weight"] = norm(p + theirs + ".weight")
            bias(p + theirs, q + ours)
        if not spec.has_mixer(i):
            w.update(_mlp_weights(spec, sd, i))
            continue
        attn = p + "self_attn."
        if spec.layer_types[i:i + 1] == ("zamba",):  # (Zamba2) its mixer, its shared block's weights (once a
            # block) and its own adapters and linear
            w.update({**_mamba_weights(spec, sd, i), **_zamba_weights(spec, sd, i)})
            continue
        if spec.is_mamba(i) and spec.attends(i):  # (Falcon-H1) a Mamba-2 mixer beside the attention
            w.update(_mamba_weights(spec, sd, i))
        elif not spec.attends(i):  # (LFM2, Qwen3.5, Mamba-2 hybrids) a convolution, a Gated DeltaNet or a Mamba-2
            # mixer in the attention's place
            w.update(_conv_weights(sd, i) if spec.is_conv(i)
                     else (_kda_weights if spec.linear_kind == "kda" else _gdn_weights)(sd, i) if spec.is_linear(i)
                     else _mamba_weights(spec, sd, i))
            if spec.has_mlp(i):
                w.update(_mlp_weights(spec, sd, i))
            continue
        own = "q" if spec.shares_kv(i) else "qk" if spec.k_eq_v(i) else "qkv"  # (q alone where the layer reads
        # another's cache; q and k where its values are its keys)
        if spec.moa_experts:  # (JetMoE) its mixture of attention: every expert's q and o product, shared k and v
            w.update(_moa_weights(spec, sd, i))
            w.update(_mlp_weights(spec, sd, i))
            continue
        if spec.mla_kv_rank:
            w.update(_mla_weights(spec, sd, i))
        elif attn + "qkv_proj.weight" in sd:
            w[q + "qkv.weight"] = sd[attn + "qkv_proj.weight"].T.copy()
        else:
            w[q + "qkv.weight"] = np.concatenate([sd[attn + f"{n}_proj.weight"] for n in own], axis=0).T.copy()
        if spec.qkv_bias and not spec.mla_kv_rank:
            w[q + "qkv.bias"] = (sd[attn + "qkv_proj.bias"] if attn + "qkv_proj.bias" in sd
                                 else np.concatenate([sd[attn + f"{n}_proj.bias"] for n in own]))
        w[q + "o.weight"] = sd[attn + "o_proj.weight"].T.copy()
        bias(attn + "o_proj", q + "o")
        if spec.qk_norm and (not spec.qk_norm_layers or spec.qk_norm_layers[i]):
            w[q + "q_norm.weight"] = norm(attn + "q_norm.weight")
            if not spec.shares_kv(i):
                w[q + "k_norm.weight"] = norm(attn + "k_norm.weight")
                if spec.v_norm:
                    w[q + "v_norm.weight"] = norm(attn + "v_norm.weight")
        if spec.attn_output_gate:  # AFMoE
            w[q + "attn_gate.weight"] = sd[attn + "gate_proj.weight"].T.copy()
        if spec.attn_sinks:  # GPT-OSS
            w[q + "attn.sinks"] = sd[attn + "sinks"]
        if spec.sub_norms:  # BitNet
            w[q + "attn_sub_norm.weight"] = sd[attn + "attn_sub_norm.weight"]
            w[q + "mlp_sub_norm.weight"] = sd[p + "mlp.ffn_sub_norm.weight"]
        if spec.has_mlp(i):
            w.update(_mlp_weights(spec, sd, i))
    return w


def _each_layer(layers: int, w: dict[str, np.ndarray], release: LayerRelease | None) -> Iterator[int]:
    """range(layers), handing each layer's weights to `release` once the loop's body is done with it (continue
    included)."""
    for i in range(layers):
        yield i
        if release is not None:
            release.layer(i, w)


def _moa_weights(spec: ModelSpec, sd: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """A mixture of attention's canonical weights (ModelSpec.moa_experts): the router, each expert's q and o product
    (layers.i.moa.e.q / .o), the shared k / v product, and the bias added once after the experts' outputs."""
    moa, q = f"model.layers.{i}.self_attn.experts.", f"layers.{i}."
    queries, outputs = sd[moa + "input_linear.weight"], sd[moa + "output_linear.weight"]  # [E, Hkv D, hidden], [E, hidden, Hkv D]
    w = {q + "moa_router.weight": sd[moa + "router.layer.weight"].T.copy(),
         q + "kv.weight": sd[f"model.layers.{i}.self_attn.kv_proj.weight"].T.copy(),  # [k, v] columns
         q + "moa.bias": sd[moa + "bias"]}
    for e in range(spec.moa_experts):
        w[f"{q}moa.{e}.q.weight"] = queries[e].T.copy()
        w[f"{q}moa.{e}.o.weight"] = outputs[e].T.copy()
    return w


def _mla(model: Any, config: Any) -> dict[str, Any]:
    """Multi-head latent attention's spec fields: one KV head of the latent and the rotated key, every query head
    on it (manifest.ModelSpec), the softmax's scale as the model's module has it (YaRN's mscale folded in)."""
    rope, kv_rank = int(config.qk_rope_head_dim), int(config.kv_lora_rank)
    if rope % 2 or rope <= 0:
        _refuse("qk_rope_head_dim", rope, "MLA's rotated dims must be a positive even count")
    return {"num_kv_heads": 1, "head_dim": kv_rank + rope, "rotary_dim": rope, "mla_kv_rank": kv_rank,
            "mla_q_rank": int(_get(config, "q_lora_rank", 0) or 0), "mla_nope_dim": int(config.qk_nope_head_dim),
            "mla_v_dim": int(config.v_head_dim), "qkv_bias": False,
            "attention_scale": float(next(layer.self_attn.scaling for layer in _base(model).layers  # (the first
                                          if hasattr(getattr(layer, "self_attn", None), "scaling")))}  # that attends)


def _mla_weights(spec: ModelSpec, sd: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """A latent-attention layer's canonical weights: the q products (their columns per head [rotated, nope]), kv_a
    ([rotated key, latent]), the latent's and q's norms, and kv_b_proj split into k_up [H, nope, C] (the queries'
    side) and v_up [H, C, V] (the output's)."""
    attn, q = f"model.layers.{i}.self_attn.", f"layers.{i}."
    H, C, R = spec.num_heads, spec.mla_kv_rank, spec.rotated_dims
    nope, v = spec.mla_nope_dim, spec.mla_v_dim

    def rope_first(w: np.ndarray, n: int) -> np.ndarray:  # [n * (X + R), ...] -> each block [R, X]
        blocks = w.reshape(n, -1, *w.shape[1:])
        return np.concatenate([blocks[:, -R:], blocks[:, :-R]], axis=1).reshape(w.shape)

    out: dict[str, np.ndarray] = {}
    if spec.mla_q_rank:
        out[q + "q_a.weight"] = sd[attn + "q_a_proj.weight"].T.copy()
        if attn + "q_a_proj.bias" in sd:
            out[q + "q_a.bias"] = sd[attn + "q_a_proj.bias"]
        out[q + "q_a_norm.weight"] = sd[attn + "q_a_layernorm.weight"]
        out[q + "q_b.weight"] = rope_first(sd[attn + "q_b_proj.weight"], H).T.copy()
    else:
        out[q + "q.weight"] = rope_first(sd[attn + "q_proj.weight"], H).T.copy()
    out[q + "kv_a.weight"] = rope_first(sd[attn + "kv_a_proj_with_mqa.weight"], 1).T.copy()
    if attn + "kv_a_proj_with_mqa.bias" in sd:
        out[q + "kv_a.bias"] = rope_first(sd[attn + "kv_a_proj_with_mqa.bias"], 1)
    out[q + "kv_a_norm.weight"] = sd[attn + "kv_a_layernorm.weight"]
    kv_b = sd[attn + "kv_b_proj.weight"].reshape(H, nope + v, C)
    out[q + "attn.k_up"] = np.ascontiguousarray(kv_b[:, :nope])  # q_nope [nope] @ k_up[h] -> [C]
    out[q + "attn.v_up"] = np.ascontiguousarray(kv_b[:, nope:].transpose(0, 2, 1))  # latent [C] @ v_up[h] -> [V]
    return out


def _mlp_weights(spec: ModelSpec, sd: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    p, q = f"model.layers.{i}.mlp.", f"layers.{i}."
    if spec.moe_beside_mlp and spec.is_moe(i):
        return _gemma4_moe_weights(spec, sd, i)
    if spec.is_moe(i):
        from llmc.graph.moe import CORRECTION_BIAS, canonical_from_hf

        out = canonical_from_hf(sd, p, q.rstrip("."))
        if p + "moe_output_bias" in sd:  # (JetMoE) a bias added after the mixture: each expert's down bias (the
            # routing weights sum to 1), the router's and gate_up's zero
            from llmc.graph.moe import DOWN_BIAS, GATE_UP_BIAS, ROUTER_BIAS

            experts, width = spec.num_experts, 2 * spec.moe_intermediate_size
            out.update({q + ROUTER_BIAS: np.zeros(experts, np.float32),
                        q + GATE_UP_BIAS: np.zeros((experts, width), np.float32),
                        q + DOWN_BIAS: np.tile(sd[p + "moe_output_bias"], (experts, 1))})
        if spec.moe_routing in ("sigmoid", "sigmoid_logits") and q + CORRECTION_BIAS not in out:
            # (a checkpoint without one chooses by the scores or logits as they are: Flint, Llama 4, Cohere 2 MoE)
            out[q + CORRECTION_BIAS] = np.zeros(spec.num_experts, np.float32)
        if spec.moe_post_norm:  # (A.X K1)
            out[q + "moe_norm.weight"] = sd[p + "post_mlp_layernorm.weight"]
        if spec.moe_latent_size:  # (Nemotron-H's latent experts: the projections around them)
            for theirs, ours in (("fc1_latent_proj", "moe_latent_in"), ("fc2_latent_proj", "moe_latent_out")):
                out[q + ours + ".weight"] = sd[p + theirs + ".weight"].T.copy()
                if p + theirs + ".bias" in sd:
                    out[q + ours + ".bias"] = sd[p + theirs + ".bias"]
        if spec.shared_expert_size and spec.plain_mlp:  # (Nemotron-H's: a plain MLP, up and down)
            s = p + "shared_experts."
            out.update({q + "shared_expert.fc.weight": sd[s + "up_proj.weight"].T.copy(),
                        q + "shared_expert.proj.weight": sd[s + "down_proj.weight"].T.copy()})
        elif spec.shared_expert_size:  # Qwen2-MoE's (gated), GLM-4.5's (its shared experts as one MLP)
            s = p + ("shared_expert." if spec.shared_expert_gated else "shared_experts.")
            gate_up = np.concatenate([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]], axis=0)
            out.update({q + "shared_expert.gate_up.weight": gate_up.T.copy(),
                        q + "shared_expert.down.weight": sd[s + "down_proj.weight"].T.copy()})
            if spec.shared_expert_gated:
                out[q + "shared_expert_gate.weight"] = sd[p + "shared_expert_gate.weight"].T.copy()
        return out
    if spec.plain_mlp:  # StarCoder2
        out = {q + "fc.weight": sd[p + "c_fc.weight"].T.copy(),
               q + "proj.weight": sd[p + "c_proj.weight"].T.copy()}
        if spec.activation == "xielu":  # (Apertus) its layer's [alpha_p, alpha_n, beta, eps], alphas as applied
            act = p + "act_fn."
            beta = float(sd[act + "beta"])
            out[q + XIELU] = np.array([_softplus(sd[act + "alpha_p"]), beta + _softplus(sd[act + "alpha_n"]), beta,
                                       float(sd[act + "eps"])], np.float32)
        for theirs, ours in (("c_fc", "fc"), ("c_proj", "proj")):
            if p + theirs + ".bias" in sd:
                out[q + ours + ".bias"] = sd[p + theirs + ".bias"]
        return out
    if p + "gate_up_proj.weight" in sd:  # Phi-3: already fused, gate first
        gate_up = sd[p + "gate_up_proj.weight"]
    else:
        gate_up = np.concatenate([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]], axis=0)
    return {q + "gate_up.weight": gate_up.T.copy(), q + "down.weight": sd[p + "down_proj.weight"].T.copy()}


# -- GPT-2 --------------------------------------------------------------------------------------------------------

def _gpt2(config: Any, sd: dict[str, np.ndarray], release: LayerRelease) -> Checkpoint:
    """GPT-2: its Conv1D weights are [in, out] already, held as they are (nothing to release)."""
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


def _gpt_bigcode(config: Any, sd: dict[str, np.ndarray], release: LayerRelease) -> Checkpoint:
    """StarCoder / SantaCoder: GPT-2 with nn.Linear weights, one KV head (`multi_query`), an optional unscaled
    attention and an untied head."""
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    release.watch(sd)
    heads, hidden = int(config.n_head), int(config.n_embd)
    head_dim = hidden // heads
    kv_heads = 1 if config.multi_query else heads
    tied = bool(_get(config, "tie_word_embeddings", True))
    spec = ModelSpec(
        family="gpt2", hf_architecture="GPTBigCodeForCausalLM", hidden_size=hidden, num_layers=int(config.n_layer),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(config.n_inner or 4 * hidden),
        vocab_size=int(config.vocab_size), max_positions=int(config.n_positions), norm="layer",
        norm_eps=float(config.layer_norm_epsilon), activation=_activation(config.activation_function),
        positions="learned", qkv_bias=True, tie_embeddings=tied,
        attention_scale=0.0 if config.scale_attn_weights else 1.0)
    w = {"embed.weight": sd["wte.weight"], "pos_embed.weight": sd["wpe.weight"], "norm.weight": sd["ln_f.weight"],
         "norm.bias": sd["ln_f.bias"], **({} if tied else {"lm_head.weight": sd["lm_head.weight"]})}
    for i in _each_layer(spec.num_layers, w, release):
        p = f"h.{i}."
        for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2"), ("qkv", "attn.c_attn"), ("o", "attn.c_proj"),
                             ("fc", "mlp.c_fc"), ("proj", "mlp.c_proj")):
            weight, bias = sd[p + theirs + ".weight"], sd[p + theirs + ".bias"]
            if ours == "qkv" and kv_heads == heads:  # rows interleaved per head, [H, 3, D]: as q, k, v
                weight = weight.reshape(heads, 3, head_dim, -1).transpose(1, 0, 2, 3).reshape(weight.shape)
                bias = bias.reshape(heads, 3, head_dim).transpose(1, 0, 2).reshape(-1)
            w[f"layers.{i}.{ours}.weight"] = weight.T.copy() if weight.ndim == 2 else weight
            w[f"layers.{i}.{ours}.bias"] = np.ascontiguousarray(bias)
    return Checkpoint(spec, w)


OPT_POSITION_OFFSET = 2  # OPT's position table starts 2 rows in (transformers' OPTLearnedPositionalEmbedding)


def _opt(config: Any, sd: dict[str, np.ndarray], release: LayerRelease) -> Checkpoint:
    """OPT: learned positions (its table 2 rows in), LayerNorm, ReLU, separate q/k/v, biases."""
    if not config.do_layer_norm_before:
        _refuse("do_layer_norm_before", False, "norms after each block (OPT-350m) are not implemented")
    if int(config.word_embed_proj_dim) != int(config.hidden_size):
        _refuse("word_embed_proj_dim", config.word_embed_proj_dim, "projected embeddings are not implemented")
    if _get(config, "_remove_final_layer_norm", False):
        _refuse("_remove_final_layer_norm", True, "llmc ends every decoder with its norm")
    sd = {k.removeprefix("model.decoder."): v for k, v in sd.items()}
    release.watch(sd)
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    tied = bool(_get(config, "tie_word_embeddings", True))
    spec = ModelSpec(
        family="gpt2", hf_architecture="OPTForCausalLM", hidden_size=hidden,
        num_layers=int(config.num_hidden_layers),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=int(config.ffn_dim),
        vocab_size=int(config.vocab_size), max_positions=int(config.max_position_embeddings), norm="layer",
        norm_eps=1e-5, activation=_activation(config.activation_function), positions="learned",
        qkv_bias="layers.0.self_attn.q_proj.bias" in sd, tie_embeddings=tied)
    ones, zeros = np.ones(hidden, np.float32), np.zeros(hidden, np.float32)
    w = {"embed.weight": sd["embed_tokens.weight"],
         "pos_embed.weight": np.ascontiguousarray(sd["embed_positions.weight"][OPT_POSITION_OFFSET:]),
         "norm.weight": sd.get("final_layer_norm.weight", ones),
         "norm.bias": sd.get("final_layer_norm.bias", zeros),
         **({} if tied else {"lm_head.weight": sd["lm_head.weight"]})}
    for i in _each_layer(spec.num_layers, w, release):
        p = f"layers.{i}."  # (the same prefix in both namings, once "model.decoder." is off)
        for ours, theirs in (("norm1", "self_attn_layer_norm"), ("norm2", "final_layer_norm")):
            w[p + ours + ".weight"] = sd.get(p + theirs + ".weight", ones)  # (no elementwise affine: 1 and 0)
            w[p + ours + ".bias"] = sd.get(p + theirs + ".bias", zeros)
        attn = p + "self_attn."
        w[p + "qkv.weight"] = np.concatenate([sd[attn + f"{n}_proj.weight"] for n in "qkv"], axis=0).T.copy()
        if spec.qkv_bias:
            w[p + "qkv.bias"] = np.concatenate([sd[attn + f"{n}_proj.bias"] for n in "qkv"])
        for ours, theirs in (("o", attn + "out_proj"), ("fc", p + "fc1"), ("proj", p + "fc2")):
            w[p + ours + ".weight"] = sd[theirs + ".weight"].T.copy()
            if theirs + ".bias" in sd:
                w[p + ours + ".bias"] = sd[theirs + ".bias"]
    return Checkpoint(spec, w)


_LEARNED: dict[str, Callable[[Any, dict[str, np.ndarray], LayerRelease], Checkpoint]] = {
    "gpt2": _gpt2, "gpt_bigcode": _gpt_bigcode, "opt": _opt}


def _softplus(x: np.ndarray) -> float:
    """torch's softplus of a one-element array (x past 20: x itself), in fp32."""
    v = np.float32(x.reshape(-1)[0])
    return float(v if v > 20 else np.log1p(np.exp(v)))


def _activation(name: str) -> str:
    if name in ("silu", "relu", "relu2", "xielu"):
        return name
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return "gelu_tanh"
    if name == "gelu":
        return "gelu"
    raise UnsupportedModelError(f"activation {name!r} is not supported; supported: silu, relu, relu2, gelu, gelu_new, "
                                "gelu_pytorch_tanh, xielu")
