"""Ministral 3 (llama.cpp's `mistral3`, transformers' `ministral3`): the text of `Mistral3ForConditionalGeneration`
/ `Ministral3ForCausalLM` as the converter's `Mistral3Model.Ministral3Model` (a `LlamaModel`) writes it, and Mistral's
own format (`MistralModel`) where its params.json has `llama_4_scaling` (without it that converter writes `llama`,
which transformers' reader reads).

The file: `LlamaModel`'s keys (the head size as `attention.key_length` where the config has one: 14B's 128 is not
width / heads; the rotated dims, the whole head), yarn as `rope.scaling.*` (type, factor, original context, betas),
yarn's `mscale_all_dim` as `rope.scaling.yarn_log_multiplier`, Llama 4's attention temperature
(`llama_4_scaling_beta`) as `attention.temperature_scale`; q / k rows reordered for llama.cpp's rotary
(`LlamaModel.permute`, undone here).

What llama.cpp computes from them (src/models/mistral3.cpp, its hparams, llama-context's yarn): the rotary's
magnitude is get_mscale(factor, 1) / get_mscale(factor, yarn_log_multiplier) (mscale taken as 1), or
get_mscale(factor, 1) without the key, which is transformers' yarn with mscale 1 and mscale_all_dim the multiplier;
queries are multiplied by 1 + beta * ln(1 + floor(pos / original context)) (no offset; the context where no yarn
gives it), which is transformers' Ministral 3 with llama_4_scaling_beta beta (0: none, a file without the key, as
Mistral Small 3.x checkpoints converted from Hugging Face are); no window (llama.cpp's mistral3 attends fully
whatever `attention.sliding_window` says), no biases (a file's would be left unread: refused), no experts (ditto).

Refused by key: a rotated share other than the head, `attention.scale` (llama.cpp's graph takes it over
1 / sqrt(head); transformers' Ministral 3 has no such field), `rope.scaling.attn_factor` other than 1 (it multiplies
llama.cpp's yarn magnitude), a temperature without a context to floor positions by, a rotary scaling other than none,
linear and yarn."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import kv_heads, unpermuted_qk, whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, _scaled_rope, plain_scaling, text_config

_LOG_MUL = "rope.scaling.yarn_log_multiplier"


def _head(g: GGUFFile) -> int:
    k = g.keys
    return int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))


def _rope(g: GGUFFile) -> dict[str, Any]:
    """transformers' rope_parameters of the file: its rotary base and scaling (yarn's magnitude from the log
    multiplier, as llama.cpp takes it), the attention temperature and the context it floors positions by."""
    k = g.keys
    kind = plain_scaling(g, "Ministral 3")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 10_000.0))}
    rope.update(_scaled_rope({key: v for key, v in k.items() if key != _LOG_MUL}, g.tensors, g.path, g.arch))
    log_mul = float(k.get(_LOG_MUL, 0.0))
    if kind == "yarn" and log_mul != 0.0:
        rope.update(mscale=1.0, mscale_all_dim=log_mul)
    beta = float(k.get("attention.temperature_scale", 0.0))
    context = k.get("rope.scaling.original_context_length", k.get("context_length"))
    if beta != 0.0 and not context:
        raise UnsupportedModelError(f"{g.path}: mistral3.attention.temperature_scale {beta} without "
                                    "rope.scaling.original_context_length to floor positions by (llama.cpp refuses it)")
    rope["llama_4_scaling_beta"] = beta
    rope.setdefault("original_max_position_embeddings", int(context or 1))
    return rope


def _ministral3(g: GGUFFile) -> Any:
    k = g.keys
    head = _head(g)
    whole_head_rotated(g, head)
    if float(k.get("attention.scale", 0.0) or 0.0) != 0.0:
        raise UnsupportedModelError(f"{g.path}: mistral3.attention.scale {k['attention.scale']}: llama.cpp's "
                                    "Ministral 3 scales queries by it, transformers' by 1 / sqrt(head size)")
    absent = {name: None for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                                            ("pad_token_id", "tokenizer.ggml.padding_token_id"))
              if key not in g.reader.fields}  # (not the class's 1 / 11)
    return text_config(g, "ministral3", head_dim=head, num_key_value_heads=kv_heads(g), hidden_act="silu",
                       sliding_window=None, rope_parameters=_rope(g), **absent)


FAMILIES = (Family("mistral3", "ministral3", "Ministral 3", _ministral3, values=unpermuted_qk),)
