"""GGUF files of tiny models written as llama.cpp's `convert_hf_to_gguf.py` writes their families (metadata keys,
tensor names and layouts), in F32 (gpt-oss's experts also in MXFP4, as published) so that a reader's result can be
compared exactly with the model it came from."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _tokenizer(writer: Any, folder: Path, vocab_size: int) -> None:
    """The tiny models' byte-level BPE as llama.cpp's `_set_vocab_gpt2` writes one (tokens, types, merges)."""
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens: list[str | None] = [None] * vocab_size
    for text, i in {**spec["model"]["vocab"], **added}.items():
        tokens[i] = text
    types = [gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens]
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i], types[i] = f"[PAD{i}]", gguf.TokenType.UNUSED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(added["<|im_start|>"])
    writer.add_eos_token_id(added["<|im_end|>"])
    writer.add_pad_token_id(added["<|endoftext|>"])


def write_gemma4(model: Any, folder: Path, out: Path, leave_out: tuple[str, ...] = (),
                 metadata: dict[str, Any] | None = None) -> Path:
    """A transformers Gemma4ForCausalLM (saved with its tokenizer in `folder`) as llama.cpp's `Gemma4Model` writes
    it: norms as they are (Gemma 4's are not 1 + w), the per-layer head counts and feed-forward widths as arrays
    where they differ, the full layers' rotary fraction as `rope_freqs` (1 for a rotated pair, 1e30 for the rest),
    `layer_scalar` and the experts under `.weight` names, the router's scale and each expert's scale as `.scale`
    tensors of `ffn_gate_inp` and `ffn_down_exps`. `leave_out` drops metadata keys or tensors by name, `metadata`
    replaces keys' values (of the same type): the files llmc must refuse."""
    import gguf

    c = model.config
    n = c.num_hidden_layers
    full = c.layer_types.index("full_attention")
    local = c.layer_types.index("sliding_attention")
    head, head_local = int(c.per_layer_config[full].head_dim), int(c.per_layer_config[local].head_dim)
    kv_full, kv_local = (int(c.per_layer_config[i].num_key_value_heads) for i in (full, local))
    sliding = [t == "sliding_attention" for t in c.layer_types]
    shared = c.num_kv_shared_layers or 0
    w = gguf.GGUFWriter(str(out), "gemma4")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(n)
    if c.use_double_wide_mlp:
        w.add_feed_forward_length([c.intermediate_size * (2 if i >= n - shared else 1) for i in range(n)])
    else:
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    if kv_full != kv_local:
        w.add_head_count_kv([kv_local if s else kv_full for s in sliding])
    else:
        w.add_head_count_kv(kv_local)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_key_length_swa(head_local)
    w.add_value_length_swa(head_local)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
    w.add_sliding_window_pattern(sliding)
    w.add_rope_dimension_count(head)
    w.add_rope_dimension_count_swa(int(head_local * rope["sliding_attention"].get("partial_rotary_factor", 1.0)))
    _tokenizer(w, folder, c.vocab_size)
    rotated = int(head * rope["full_attention"]["partial_rotary_factor"] / 2)
    if "rope_freqs.weight" not in leave_out:
        w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (head // 2 - rotated), dtype=np.float32))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        bid = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("router.scale"):
            w.add_tensor(f"blk.{bid}.ffn_gate_inp.scale", values)
            continue
        if name.endswith("router.per_expert_scale"):
            w.add_tensor(f"blk.{bid}.ffn_down_exps.scale", values)
            continue
        if name.endswith(("per_dim_scale", "layer_scalar")) or (".experts." in name and not name.endswith(".weight")):
            name += ".weight"
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        if mapped in leave_out:
            continue
        w.add_tensor(mapped, values.reshape(1) if values.ndim == 0 else values)
    _finish(w, leave_out, metadata)
    return out


def _finish(w: Any, leave_out: tuple[str, ...], metadata: dict[str, Any] | None,
            extra: dict[str, np.ndarray] | None = None) -> None:
    """Metadata keys replaced (same types) or left out, `extra` tensors added, then the file written."""
    import gguf

    for name, values in (extra or {}).items():
        w.add_tensor(name, values)
    kv = w.kv_data[0]
    for key, value in (metadata or {}).items():
        kv[key] = gguf.GGUFValue(value=value, type=kv[key].type, sub_type=kv[key].sub_type)
    for key in leave_out:
        kv.pop(key, None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def round_experts_mxfp4(model: Any) -> None:
    """A gpt-oss model's expert weights rounded in place to MXFP4 in the rows the file stores them in (each row's
    blocks of 32 along its inputs), so that a file of MXFP4 experts holds exactly the model's values."""
    import gguf
    import torch
    from gguf.quants import dequantize, quantize

    kind = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows = p.detach().numpy().transpose(0, 2, 1)
                rounded = dequantize(quantize(np.ascontiguousarray(rows), kind), kind).reshape(rows.shape)
                p.copy_(torch.from_numpy(np.ascontiguousarray(rounded.transpose(0, 2, 1))))


def write_gpt_oss(model: Any, folder: Path, out: Path, leave_out: tuple[str, ...] = (), mxfp4: bool = False) -> Path:
    """A transformers GptOssForCausalLM as llama.cpp's `GptOssModel` writes an unquantized one: each layer's experts
    transposed to rows of outputs, the interleaved gate / up columns (and biases) split into `ffn_gate_exps` and
    `ffn_up_exps`, the sinks as `attn_sinks.weight`, yarn as the `rope.scaling.*` keys (the layer pattern, the
    SwiGLU limit and yarn's truncation are the family's, not in the file); `mxfp4`: the experts' weights in MXFP4, as
    published (round them first: `round_experts_mxfp4`)."""
    import gguf

    c = model.config
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_rope_scaling_type, gguf.RopeScalingType.YARN), (w.add_rope_scaling_factor, rope["factor"]),
                       (w.add_rope_scaling_orig_ctx_len, rope["original_max_position_embeddings"]),
                       (w.add_rope_scaling_yarn_beta_fast, rope["beta_fast"]),
                       (w.add_rope_scaling_yarn_beta_slow, rope["beta_slow"]), (w.add_rope_freq_base, rope["rope_theta"]),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_expert_count, c.num_local_experts),
                       (w.add_expert_used_count, c.num_experts_per_tok), (w.add_key_length, c.head_dim),
                       (w.add_value_length, c.head_dim), (w.add_sliding_window, c.sliding_window),
                       (w.add_expert_feed_forward_length, c.intermediate_size)):
        add(value)
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        parts: list[tuple[str, np.ndarray]] = []
        if name.endswith("experts.gate_up_proj"):  # [E, H, 2I] -> [E, 2I, H], gate rows even, up rows odd
            rows = values.transpose(0, 2, 1)
            parts = [(name.replace("gate_up_proj", "gate_proj.weight"), rows[:, ::2]),
                     (name.replace("gate_up_proj", "up_proj.weight"), rows[:, 1::2])]
        elif name.endswith("experts.gate_up_proj_bias"):
            parts = [(name.replace("gate_up_proj_bias", "gate_proj.bias"), values[..., ::2]),
                     (name.replace("gate_up_proj_bias", "up_proj.bias"), values[..., 1::2])]
        elif name.endswith("experts.down_proj"):
            parts = [(name + ".weight", values.transpose(0, 2, 1))]
        elif name.endswith("experts.down_proj_bias"):
            parts = [(name.replace("down_proj_bias", "down_proj.bias"), values)]
        elif name.endswith("sinks"):
            parts = [(name + ".weight", values)]
        else:
            parts = [(name, values)]
        for hf_name, array in parts:
            mapped = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                raise ValueError(f"gguf has no name for {hf_name}")
            if mxfp4 and array.ndim == 3:
                kind = gguf.GGMLQuantizationType.MXFP4
                w.add_tensor(mapped, gguf.quants.quantize(np.ascontiguousarray(array), kind), raw_dtype=kind)
            else:
                w.add_tensor(mapped, np.ascontiguousarray(array))
    _finish(w, leave_out, None)
    return out


def _llama3_divisors(rope: dict[str, Any], dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` for a llama3 rotary: each frequency's divisor (1, the factor, or the blend)."""
    import math

    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of a Llama q / k product's rows (each head's rotary halves interleaved)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


# a tensor's transform for `add_tensors`: its values, or the (gguf name, values) pairs written in its place
Transform = Callable[[str, np.ndarray], "np.ndarray | list[tuple[str, np.ndarray]]"]


def permute_qk(config: Any) -> Transform:
    """A transform for `add_tensors`: Llama's q / k rows (and biases) reordered (`_permute`), the rest as it is."""
    def transform(name: str, values: np.ndarray) -> np.ndarray:
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return _permute(values, config.num_attention_heads)
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return _permute(values, config.num_key_value_heads)
        return values
    return transform


def add_keys(w: Any, **values: Any) -> None:
    """Metadata keys in the order given, each by the writer's own call (`head_count=4`: `w.add_head_count(4)`)."""
    for key, value in values.items():
        getattr(w, f"add_{key}")(value)


_TEXT_KEYS = (("block_count", "num_hidden_layers"), ("context_length", "max_position_embeddings"),
              ("embedding_length", "hidden_size"), ("feed_forward_length", "intermediate_size"),
              ("head_count", "num_attention_heads"), ("head_count_kv", "num_key_value_heads"))


def add_text_keys(w: Any, config: Any, **values: Any) -> None:
    """The six keys `TextModel.set_gguf_parameters` begins with (layers, context, width, MLP width, heads, KV heads)
    from `config`, a key named in `values` taking its value there instead; then `values`' other keys (`add_keys`)."""
    add_keys(w, **{key: values[key] if key in values else getattr(config, field) for key, field in _TEXT_KEYS},
             **{key: value for key, value in values.items() if key not in dict(_TEXT_KEYS)})


_YARN_KEYS = {"extrapolation_factor": "yarn_ext_factor", "attention_factor": "yarn_attn_factor",
              "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}


def add_yarn_keys(w: Any, rope: dict[str, Any], optional: tuple[str, ...] = ("beta_fast", "beta_slow")) -> None:
    """yarn's `rope.scaling.*` keys from the rotary parameters `rope`: type, factor, original context, then each of
    `optional` (`extrapolation_factor`, `attention_factor`, `beta_fast`, `beta_slow`) the parameters give."""
    import gguf

    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key in optional:
        if rope.get(key) is not None:
            getattr(w, f"add_rope_scaling_{_YARN_KEYS[key]}")(rope[key])


def add_tensors(w: Any, model: Any, arch: Any, transform: Transform | None = None,
                skip: Callable[[str], bool] | None = None, blocks: int | None = None) -> None:
    """Every tensor of `model` under gguf's name for `arch` (a `gguf.MODEL_ARCH` or its name; `blocks` layers, the
    config's by default), through `transform(name, values)` where given (a list from it: the tensors written under
    the gguf names it gives instead); the head left out where tied, and the names `skip` says."""
    import gguf

    c = model.config
    if isinstance(arch, str):
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers if blocks is None else blocks)
    for name, tensor in model.state_dict().items():
        if (name == "lm_head.weight" and c.tie_word_embeddings) or (skip is not None and skip(name)):
            continue
        values = tensor.detach().float().numpy()
        if transform is not None:
            written = transform(name, values)
            if isinstance(written, list):
                for mapped, array in written:
                    w.add_tensor(mapped, np.ascontiguousarray(array))
                continue
            values = written
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        w.add_tensor(mapped, np.ascontiguousarray(values))


ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
         "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
         "lfm2": "lfm2"}


def write_family(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                 extra: dict[str, np.ndarray] | None = None) -> Path:
    """A transformers model of a family transformers' GGUF reader handles (Llama, Mistral, Qwen2, Qwen3, Qwen2 /
    Qwen3-MoE, Gemma 2, Gemma 3, Phi-3, LFM2) as llama.cpp's converter writes it: the base metadata; the experts stacked
    per projection (their widths as `expert_*feed_forward_length`, the shared expert's gate as one row); the
    rotary's scaling as `rope.scaling.*` keys (linear, yarn; Gemma 3's from its full layers' parameters), for llama3
    as the `rope_freqs` divisors, for Phi-3's longrope as its factor tensors, attention factor and original context
    (no type key); Llama's q / k rows reordered; Gemma's norms stored as 1 + w; Gemma's soft-caps and window;
    Phi-3's rotated dims and window; LFM2's KV heads per layer (0 on a convolution), its computed MLP width, its
    convolutions' taps as 2-D weights.
    `metadata` replaces keys' values (of the same type); `extra` adds tensors."""
    import gguf

    c = model.config
    arch = ARCHS[c.model_type]
    rope = dict(c.rope_parameters)
    full = rope.get("full_attention", rope)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    ff = c.intermediate_size
    if arch == "lfm2" and c.block_auto_adjust_ff_dim:  # (LFM2's MLP width as its converter computes it)
        ff = int(c.block_ffn_dim_multiplier * int(2 * ff / 3))
        ff = c.block_multiple_of * ((ff + c.block_multiple_of - 1) // c.block_multiple_of)
    kv = ([c.num_key_value_heads if t != "conv" else 0 for t in c.layer_types] if arch == "lfm2"
          else c.num_key_value_heads)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{c.model_type}")  # (transformers' older reader takes a "llama" file named Mistral as Mistral)
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, ff),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, kv),
                       (w.add_rope_freq_base, full["rope_theta"]),
                       (w.add_layer_norm_rms_eps, getattr(c, "rms_norm_eps", None) or c.norm_eps),
                       (w.add_key_length, head), (w.add_value_length, head)):
        add(value)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    elif full.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if getattr(c, "num_experts", None):
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch == "llama":
        w.add_rope_dimension_count(head)
        if full.get("rope_type") == "llama3":
            w.add_tensor("rope_freqs.weight", _llama3_divisors(full, head))
    if arch == "lfm2":
        w.add_vocab_size(c.vocab_size)
        w.add_shortconv_l_cache(c.conv_L_cache)
    if arch == "phi3":
        import math

        rotated = int(full.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads
        w.add_rope_dimension_count(rotated)
        w.add_sliding_window(c.sliding_window or 0)
        if full.get("rope_type") == "longrope":
            orig = full["original_max_position_embeddings"]
            w.add_rope_scaling_orig_ctx_len(orig)
            scale = c.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
            w.add_tensor("rope_factors_long.weight", np.array(full["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(full["short_factor"], dtype=np.float32))
    if arch.startswith("gemma"):
        w.add_sliding_window(c.sliding_window)
        if getattr(c, "attn_logit_softcapping", None):
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        if getattr(c, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):  # (biases too)
            values = _permute(values, c.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = _permute(values, c.num_key_value_heads)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            values = values + 1
        elif name.endswith("experts.gate_up_proj"):  # (the checkpoint's experts stacked: [E, I, H] each)
            half = values.shape[1] // 2
            blk = name.split(".")[2]
            w.add_tensor(f"blk.{blk}.ffn_gate_exps.weight", np.ascontiguousarray(values[:, :half]))
            w.add_tensor(f"blk.{blk}.ffn_up_exps.weight", np.ascontiguousarray(values[:, half:]))
            continue
        elif name.endswith("experts.down_proj"):
            w.add_tensor(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", np.ascontiguousarray(values))
            continue
        elif name.endswith("shared_expert_gate.weight"):  # (one row: llama.cpp loads it as [n_embd])
            values = values.reshape(-1)
        elif "conv.conv" in name and values.ndim == 3:  # (LFM2's [hidden, 1, L] as the 2-D its op takes)
            values = values[:, 0]
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        w.add_tensor(mapped, np.ascontiguousarray(values))
    _finish(w, (), metadata, extra)
    return out


CONVERTED = {"gpt2": "gpt2", "starcoder2": "starcoder2", "falcon": "falcon", "stablelm": "stablelm",
             "nemotron": "nemotron", "mamba": "mamba", "falcon_mamba": "mamba"}


def write_converted(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                    leave_out: tuple[str, ...] = ()) -> Path:
    """GPT-2, StarCoder2, Falcon, StableLM, Nemotron and Mamba models as their converter classes write them:
    - GPT-2 (`GPT2Model`): its own keys only (the context, 4 x the width as the MLP's); c_attn / c_proj / c_fc
      transposed to rows of outputs; the attention's mask buffers left out;
    - StarCoder2 (`TextModel`'s keys: the rotary base, the LayerNorm epsilon; no window);
    - Falcon (`FalconModel`): context 2,048, 4 x the width, KV heads (1 for 7B's multi-query), the fused q / k / v
      rows regrouped into all queries, all keys, all values ("jploski");
    - StableLM (`StableLMModel`): the rotated dims, the LayerNorm epsilon, the parallel residual; 12B's per-head
      q / k norms stacked into one [heads, head size] tensor each;
    - Nemotron (`NemotronModel`): `TextModel`'s keys, the vocabulary size, both epsilon keys, the rotated dims
      from hidden / heads, the rotary scaling's type; norms stored as 1 + w;
    - Mamba (`MambaModel`): context 2^20, no heads, the four `ssm.*` sizes, the token list padded to a multiple of
      8; A as -exp(A_log) under `ssm_a`, the convolution squeezed to [inner, taps]; Falcon Mamba the same, written
      as `mamba` with `ssm.dt_b_c_rms` set.
    `metadata` replaces keys' values, `leave_out` drops keys."""
    import gguf

    c = model.config
    kind = c.model_type
    arch = CONVERTED[kind]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{kind}")
    vocab = c.vocab_size
    rope = dict(getattr(c, "rope_parameters", None) or {})
    n_kv = int(getattr(c, "num_key_value_heads", 0) or 0)
    if kind == "gpt2":
        for add, value in ((w.add_block_count, c.n_layer), (w.add_context_length, c.n_positions),
                           (w.add_embedding_length, c.n_embd), (w.add_feed_forward_length, 4 * c.n_embd),
                           (w.add_head_count, c.n_head), (w.add_layer_norm_eps, c.layer_norm_epsilon)):
            add(value)
    elif kind == "falcon":
        for add, value in ((w.add_context_length, 2048), (w.add_tensor_data_layout, "jploski"),
                           (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, 4 * c.hidden_size),
                           (w.add_block_count, c.num_hidden_layers), (w.add_head_count, c.num_attention_heads),
                           (w.add_head_count_kv, n_kv), (w.add_layer_norm_eps, c.layer_norm_epsilon)):
            add(value)
    elif kind in ("mamba", "falcon_mamba"):
        vocab = -(c.vocab_size // -8) * 8
        for add, value in ((w.add_context_length, 2**20), (w.add_embedding_length, c.hidden_size),
                           (w.add_feed_forward_length, 0), (w.add_head_count, 0),
                           (w.add_block_count, c.num_hidden_layers), (w.add_ssm_conv_kernel, c.conv_kernel),
                           (w.add_ssm_inner_size, c.intermediate_size), (w.add_ssm_state_size, c.state_size),
                           (w.add_ssm_time_step_rank, c.time_step_rank),
                           (w.add_layer_norm_rms_eps, c.layer_norm_epsilon),
                           (w.add_ssm_dt_b_c_rms, kind == "falcon_mamba")):
            add(value)
    else:  # TextModel's keys, then the family's
        for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                           (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                           (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, n_kv)):
            add(value)
        head = c.hidden_size // c.num_attention_heads
        rotated = int(rope.get("partial_rotary_factor", 1.0) * (head if kind == "stablelm" else c.hidden_size))
        if kind == "starcoder2":
            w.add_rope_freq_base(rope["rope_theta"])
            w.add_layer_norm_eps(c.norm_epsilon)
        elif kind == "stablelm":
            w.add_rope_dimension_count(rotated)
            w.add_parallel_residual(c.use_parallel_residual)
            w.add_layer_norm_eps(c.layer_norm_eps)
        else:  # nemotron
            w.add_rope_freq_base(rope["rope_theta"])
            w.add_layer_norm_rms_eps(c.norm_eps)
            w.add_key_length(c.head_dim)
            w.add_value_length(c.head_dim)
            w.add_vocab_size(c.vocab_size)
            w.add_layer_norm_eps(c.norm_eps)
            w.add_rope_dimension_count(rotated // c.num_attention_heads)
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if rope.get("factor") else gguf.RopeScalingType.NONE)
            if rope.get("factor"):
                w.add_rope_scaling_factor(rope["factor"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer(w, folder, vocab)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     c.num_hidden_layers)
    state = model.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        values = tensor.detach().float().numpy()
        if kind == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            values = values.T
        elif kind == "falcon" and "query_key_value" in name:
            heads, head = c.num_attention_heads, c.hidden_size // c.num_attention_heads
            grouped = values.reshape(n_kv, heads // n_kv + 2, head, -1)
            values = np.concatenate((grouped[:, :-2].reshape(heads * head, -1), grouped[:, -2].reshape(n_kv * head, -1),
                                     grouped[:, -1].reshape(n_kv * head, -1))).reshape(values.shape)
        elif kind == "stablelm" and "layernorm.norms." in name:  # (stacked at the first head's weight)
            if not name.endswith("norms.0.weight"):
                continue
            name = name[:name.index(".norms.")]
            count = c.num_attention_heads if "q_layernorm" in name else n_kv
            values = np.stack([state[f"{name}.norms.{h}.weight"].float().numpy() for h in range(count)])
            name += ".weight"
        elif kind == "nemotron" and name.endswith("norm.weight"):
            values = values + 1
        elif kind in ("mamba", "falcon_mamba") and name.endswith(".A_log"):
            values = -np.exp(values)
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        if mapped.endswith("ssm_conv1d.weight"):
            values = values.squeeze(1)
        w.add_tensor(mapped, np.ascontiguousarray(values))
    _finish(w, leave_out, metadata)
    return out


# a tiny model's sizes for the round trips (320 tokens: the tiny tokenizer's)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def built(tmp: Path, name: str, model: Any) -> tuple[Any, Path]:
    """A tiny model's weights moved off their start (products x4, norms and biases moved: each must show in the
    logits), saved with the tiny tokenizer into tmp / name."""
    import torch
    from tiny_models import make_tokenizer

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            else:
                p.add_(0.3 * torch.randn_like(p))
    folder = tmp / name
    model.save_pretrained(str(folder))
    make_tokenizer(folder, 320)
    return model.eval(), folder


def read_back(model: Any, path: Path, positions: int = 100) -> float:
    """The largest logit difference between `model` and the model llmc reads from its GGUF file `path` (eager
    attention) over `positions` random ids; the file must resolve to the model's family."""
    import torch

    from llmc.export.sources import load, resolve

    src = resolve(str(path))
    ours = load(src).model
    ids = torch.tensor([np.random.default_rng(1).integers(3, 320, positions).tolist()])
    with torch.no_grad():
        return float((ours(ids).logits - model(ids).logits).abs().max())
