"""Command-R / Aya 23 (llama.cpp's `command-r`, the converter's `CommandR2Model`) and Command R7B / Command A
(`cohere2`, `Cohere2Model`): `TextModel`'s keys (the LayerNorm epsilon, the rotary base), the logit scale
(`logit_scale`: the logits multiplied by it), no rotary scaling (the converter writes type none over whatever the
base wrote, and llama.cpp reads none). Neither converter reorders a tensor: Cohere's rotary pairs are interleaved,
llama.cpp's `command-r` / `cohere2` rotate them so too. Attention and MLP side by side off one bias-less LayerNorm,
the head tied (gguf's table of either has no `output`).

- Command-R: per-head q / k LayerNorms where the file has `attn_q_norm` / `attn_k_norm` (Command R+'s
  use_qk_norm), one [heads, head size] tensor each as in transformers.
- Cohere2: three sliding layers then a full one (llama.cpp's pattern is fixed at 4, as transformers' default), the
  window from `attention.sliding_window`, the full layers without rotary (both sides); the converter drops the
  checkpoint's all-zero biases, `rope.dimension_count` is the rotated share (the checkpoints' rotary_pct 1)."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import ATTENTION, bias_flag, whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _common(g: GGUFFile) -> dict[str, Any]:
    k = g.keys
    if "output.weight" in g.tensors:
        raise UnsupportedModelError(f"{g.path}: output.weight in a {g.arch} file: llama.cpp's {g.arch} ties its head "
                                    "to the embeddings")
    head = int(k["embedding_length"]) // int(k["attention.head_count"])
    if int(k.get("attention.key_length", head)) != head:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.key_length {k['attention.key_length']}: "
                                    f"transformers' Cohere has heads of width / heads ({head})")
    whole_head_rotated(g, head)
    return {"logit_scale": float(k["logit_scale"]), "tie_word_embeddings": True}


def _command_r(g: GGUFFile) -> Any:
    norms = {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} & set(g.tensors)
    if len(norms) == 1:
        raise UnsupportedModelError(f"{g.path}: {next(iter(norms))} alone: transformers' Cohere norms both queries and "
                                    "keys or neither")
    return text_config(g, "cohere", **_common(g), use_qk_norm=bool(norms),
                       attention_bias=bias_flag(g, ATTENTION, "attention_bias"))


def _cohere2(g: GGUFFile) -> Any:
    return text_config(g, "cohere2", **_common(g), sliding_window=int(g.keys["attention.sliding_window"]),
                       attention_bias=bias_flag(g, ATTENTION, "attention_bias"))


FAMILIES = (Family("command-r", "cohere", "Command-R", _command_r),
            Family("cohere2", "cohere2", "Command R7B", _cohere2))
