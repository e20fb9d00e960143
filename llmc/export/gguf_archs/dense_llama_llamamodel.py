"""Families llama.cpp's converter writes with `LlamaModel`'s keys and q / k rows reordered for its rotary
(`LlamaModel.permute`, undone here), which transformers' GGUF reader does not read:

- SmolLM3 (`smollm3`, `SmolLM3Model`): Llama's layers, every fourth without rotary (NoPE). No key says which:
  llama.cpp's SmolLM3 fixes the step at 4 (`n_no_rope_layer_step`), as transformers' default no_rope_layers
  (no_rope_layer_interval 4) and every SmolLM3 checkpoint have it.
- Arcee AFM (`arcee`, `ArceeModel`): Llama's layers with a squared-ReLU MLP of up / down only (no key says so:
  llama.cpp's Arcee graph fixes it), yarn as `rope.scaling.*`.

Both: the head size from `attention.key_length` where the config had one, biases where the file has them (llama.cpp
adds the optional q / k / v / o ones; transformers' attention_bias takes all four), llama3 rotary scaling as the
`rope_freqs` divisors; llama.cpp's graphs assert that the whole head is rotated."""

from __future__ import annotations

from typing import Any

from llmc.export.gguf_archs.dense_llama_common import (
    ATTENTION,
    MLP,
    bias_flag,
    kv_heads,
    unpermuted_qk,
    whole_head_rotated,
)
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _head(g: GGUFFile) -> int:
    k = g.keys
    return int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))


def _smollm3(g: GGUFFile) -> Any:
    whole_head_rotated(g, _head(g))
    return text_config(g, "smollm3", head_dim=_head(g), num_key_value_heads=kv_heads(g), no_rope_layer_interval=4,
                       attention_bias=bias_flag(g, ATTENTION, "attention_bias"), mlp_bias=bias_flag(g, MLP, "mlp_bias"))


def _arcee(g: GGUFFile) -> Any:
    whole_head_rotated(g, _head(g))
    return text_config(g, "arcee", head_dim=_head(g), num_key_value_heads=kv_heads(g), hidden_act="relu2",
                       attention_bias=bias_flag(g, ATTENTION, "attention_bias"))


FAMILIES = (Family("smollm3", "smollm3", "SmolLM3", _smollm3, values=unpermuted_qk),
            Family("arcee", "arcee", "Arcee AFM", _arcee, values=unpermuted_qk))
