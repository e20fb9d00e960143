"""What transformers' GGUF reader leaves out of a family, read from the file as llama.cpp's converter writes it.

transformers reads a GGUF file's config from a table of metadata keys and its tensors by mapping the model's own
parameter names through gguf's name table. For Gemma 4 both fall short of the files llama.cpp writes
(`convert_hf_to_gguf.py`, `Gemma4Model`):

- the config: per-layer KV head counts (`attention.head_count_kv` as an array: 31B and 26B-A4B) fail transformers'
  config validation; the sliding layers' head size (`attention.key_length_swa`), the layer pattern
  (`attention.sliding_window_pattern`), the KV-shared layers, the per-layer embeddings' width, the mixture's sizes,
  the doubled MLPs of the shared layers (`feed_forward_length` as an array), keys-as-values (no `attn_v` on the full
  layers) and the full layers' rotary fraction (the `rope_freqs` tensor) are not read at all, so the class defaults
  (E2B's, or none of the checkpoints') would stand in for them;
- the tensors: a layer's scalar (`layer_scalar`, written `blk.N.layer_output_scale.weight`), the stacked experts
  (`ffn_gate_up_exps.weight`, `ffn_down_exps.weight`) and the router's two scales (`ffn_gate_inp.scale`,
  `ffn_down_exps.scale`) carry a suffix transformers' map does not look for, so they would stay as initialized.

`config_for` builds the config from the file; `fill_missing` copies those tensors in. Whatever the file does not say
(the activation, biases) is the family's as every Gemma 4 checkpoint has it: the class defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from llmc.errors import InputError, UnsupportedModelError

GEMMA4 = "gemma4"


def _fields(reader: Any, arch: str) -> dict[str, Any]:
    """The file's `arch.*` metadata by key without the prefix: ints, floats, bools, strings, or lists of them."""
    import gguf

    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith(arch + "."):
            continue
        types = list(field.types)
        values: list[Any] = []
        for i in field.data:
            part = field.parts[i]
            kind = types[-1]
            if kind == gguf.GGUFValueType.STRING:
                values.append(bytes(part).decode())
            elif kind == gguf.GGUFValueType.BOOL:
                values.append(bool(part[0]))
            elif kind in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
                values.append(float(part[0]))
            else:
                values.append(int(part[0]))
        out[key[len(arch) + 1:]] = values if types[0] == gguf.GGUFValueType.ARRAY else values[0]
    return out


def _per_layer(value: Any, n: int, key: str, path: Path) -> list[Any]:
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise UnsupportedModelError(f"{path}: {key} has {len(value)} values for {n} layers")
    return value


def _one(values: list[Any], key: str, what: str, path: Path) -> Any:
    if len(set(values)) != 1:
        raise UnsupportedModelError(f"{path}: {key} differs between {what} ({sorted(set(values))}); transformers' "
                                    f"Gemma 4 takes one value for them")
    return values[0]


def _gemma4_config(reader: Any, path: Path) -> Any:
    from transformers import Gemma4TextConfig

    f = _fields(reader, GEMMA4)
    tensors = {t.name: t for t in reader.tensors}
    n = int(f["block_count"])
    if "attention.sliding_window_pattern" not in f:
        raise UnsupportedModelError(f"{path}: a Gemma 4 GGUF without {GEMMA4}.attention.sliding_window_pattern "
                                    "(which layers slide): llama.cpp's converter writes it")
    sliding = _per_layer(f["attention.sliding_window_pattern"], n, "attention.sliding_window_pattern", path)
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    full = [i for i in range(n) if not sliding[i]]
    local = [i for i in range(n) if sliding[i]]
    if not full or not local or not sliding or sliding[-1]:
        raise UnsupportedModelError(f"{path}: {GEMMA4}.attention.sliding_window_pattern {sliding} is not Gemma 4's "
                                    "(sliding and full layers, the last one full)")
    shared = int(f.get("attention.shared_kv_layers", 0))
    kv = _per_layer(f["attention.head_count_kv"], n, "attention.head_count_kv", path)
    ff = _per_layer(f["feed_forward_length"], n, "feed_forward_length", path)
    own = [i for i in full if i < n - shared]  # full layers with keys of their own
    k_eq_v = bool(own) and all(f"blk.{i}.attn_v.weight" not in tensors for i in own)
    kv_local = _one([kv[i] for i in local], "attention.head_count_kv", "sliding layers", path)
    kv_full = _one([kv[i] for i in full], "attention.head_count_kv", "full layers", path)
    if kv_full != kv_local and not k_eq_v:
        raise UnsupportedModelError(f"{path}: full layers of {kv_full} KV heads beside sliding ones of {kv_local}, "
                                    "with values of their own: transformers' Gemma 4 has such heads only where keys "
                                    "are the values")
    width = int(ff[0])
    if any(int(v) != width for v in ff[:n - shared]) or any(int(v) not in (width, 2 * width) for v in ff[n - shared:]) \
            or len({int(v) for v in ff[n - shared:]}) > 1:
        raise UnsupportedModelError(f"{path}: {GEMMA4}.feed_forward_length {ff} is not one width (twice it on the "
                                    "KV-shared layers)")
    freqs = tensors.get("rope_freqs.weight")
    if freqs is None:
        raise UnsupportedModelError(f"{path}: a Gemma 4 GGUF without rope_freqs.weight (the full layers' rotary "
                                    "fraction): llama.cpp's converter writes it")
    head, head_local = int(f["attention.key_length"]), int(f["attention.key_length_swa"])
    rotated = int((np.asarray(freqs.data) == 1.0).sum())
    local_rot = int(f.get("rope.dimension_count_swa", head_local))
    sliding_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(f.get("rope.freq_base_swa", 10_000.0))}
    if local_rot != head_local:
        sliding_rope["partial_rotary_factor"] = local_rot / head_local
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    per_layer = int(f.get("embedding_length_per_layer_input", 0))
    config: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=int(f["embedding_length"]), num_hidden_layers=n, intermediate_size=width,
        use_double_wide_mlp=shared > 0 and int(ff[-1]) == 2 * width, num_attention_heads=int(f["attention.head_count"]),
        num_key_value_heads=int(kv_local), num_global_key_value_heads=int(kv_full) if k_eq_v else None,
        head_dim=head_local, global_head_dim=head, attention_k_eq_v=k_eq_v, layer_types=types,
        sliding_window=int(f["attention.sliding_window"]), rms_norm_eps=float(f["attention.layer_norm_rms_epsilon"]),
        final_logit_softcapping=f.get("final_logit_softcapping"), num_kv_shared_layers=shared,
        hidden_size_per_layer_input=per_layer, max_position_embeddings=int(f["context_length"]),
        tie_word_embeddings="output.weight" not in tensors,
        rope_parameters={"sliding_attention": sliding_rope,
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / head,
                                            "rope_theta": float(f.get("rope.freq_base", 1_000_000.0))}},
        **_special_ids(reader))
    if per_layer:
        table = tensors.get("per_layer_token_embd.weight")
        if table is None:
            raise UnsupportedModelError(f"{path}: per-layer embeddings {per_layer} wide without "
                                        "per_layer_token_embd.weight")
        config["vocab_size_per_layer_input"] = int(table.shape[-1])  # (GGUF's dims run innermost first)
    if f.get("expert_count"):
        config.update(enable_moe_block=True, num_experts=int(f["expert_count"]),
                      top_k_experts=int(f["expert_used_count"]),
                      moe_intermediate_size=int(f["expert_feed_forward_length"]))
    return Gemma4TextConfig(**config)


def _special_ids(reader: Any) -> dict[str, Any]:
    """BOS, pad and every end of generation the file names: its EOS, its end-of-turn, and Gemma 4's end of a turn
    and of a tool's response where the vocabulary has them (as the checkpoints' generation config lists them)."""
    def scalar(key: str) -> int | None:
        field = reader.fields.get(key)
        return None if field is None else int(field.parts[field.data[0]][0])

    tokens = reader.fields["tokenizer.ggml.tokens"]
    text = {bytes(tokens.parts[i]).decode(errors="replace"): k for k, i in enumerate(tokens.data)}
    eos = [i for i in (scalar("tokenizer.ggml.eos_token_id"), scalar("tokenizer.ggml.eot_token_id"),
                       text.get("<turn|>"), text.get("<|tool_response>")) if i is not None]
    out: dict[str, Any] = {"eos_token_id": list(dict.fromkeys(eos)) or None}
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if (value := scalar(key)) is not None:
            out[name] = value
    return out


def config_for(path: Path, model_type: str) -> Any | None:
    """The transformers config of a GGUF file whose family transformers' reader gets wrong (None: its own)."""
    if model_type != "gemma4_text":
        return None
    import gguf

    try:
        return _gemma4_config(gguf.GGUFReader(str(path)), path)
    except KeyError as e:  # a key every Gemma 4 file of llama.cpp's converter has
        key = str(e.args[0])
        raise InputError(f"{path}: a Gemma 4 GGUF without "
                         f"{key if key.startswith('tokenizer.') else GEMMA4 + '.' + key}") from None


def _gemma4_name(key: str, names: Any) -> str | None:
    parts = key.split(".")
    if len(parts) < 4 or parts[1] != "layers":
        return None
    bid = parts[2]
    if key.endswith(".router.scale"):
        return f"blk.{bid}.ffn_gate_inp.scale"
    if key.endswith(".router.per_expert_scale"):
        return f"blk.{bid}.ffn_down_exps.scale"
    return names.get_name(key + ".weight", try_suffixes=(".weight",))


def fill_missing(model: Any, path: Path, model_type: str, missing: set[str]) -> set[str]:
    """Copy the tensors transformers' map missed from the file into `model`; the keys still missing."""
    if model_type != "gemma4_text" or not missing:
        return missing
    import gguf
    import torch
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, int(model.config.num_hidden_layers))
    held = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    left = set()
    for key in sorted(missing):
        name = _gemma4_name(key, names)
        t = tensors.get(name) if name else None
        target = held.get(key)
        if t is None or target is None or int(np.prod(t.shape)) != target.numel():
            left.add(key)
            continue
        values = dequantize(t.data, t.tensor_type).reshape(tuple(target.shape))
        with torch.no_grad():
            target.copy_(torch.from_numpy(np.array(values, dtype=np.float32)))
    return left

