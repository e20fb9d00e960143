"""Granite MoE (and with a shared expert) GGUF files as llama.cpp's `GraniteMoeModel` writes them, read back to the
logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _permute, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_granitemoe(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """`LlamaModel`'s keys (no head size: Granite's converter drops it; the vocabulary size, the rotated dims),
    Granite's multipliers as scales, the shared expert's width; q / k (and biases) permuted; the experts' fused
    `input_linear` split into gate and up stacks, the shared MLP's into `ffn_gate_shexp` / `ffn_up_shexp`."""
    c = model.config

    def keys(w: Any, h: dict[str, Any]) -> None:
        h = {k: v for k, v in h.items() if k != "head_dim"}
        text_keys(w, h)
        w.add_vocab_size(h["vocab_size"])
        w.add_rope_dimension_count(h["hidden_size"] // h["num_attention_heads"])
        for key, add in (("attention_multiplier", w.add_attention_scale), ("embedding_multiplier", w.add_embedding_scale),
                         ("residual_multiplier", w.add_residual_scale), ("logits_scaling", w.add_logit_scale)):
            if h.get(key):
                add(h[key])
        if h.get("shared_intermediate_size"):
            w.add_expert_shared_feed_forward_length(h["shared_intermediate_size"])

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return [(f"{blk}.attn_q.{name.rsplit('.', 1)[1]}", _permute(values, c.num_attention_heads))]
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return [(f"{blk}.attn_k.{name.rsplit('.', 1)[1]}", _permute(values, c.num_key_value_heads))]
        if name.endswith("block_sparse_moe.router.weight"):
            return [(f"{blk}.ffn_gate_inp.weight", values)]
        if name.endswith("shared_mlp.input_linear.weight"):
            half = values.shape[0] // 2
            return [(f"{blk}.ffn_gate_shexp.weight", values[:half]), (f"{blk}.ffn_up_shexp.weight", values[half:])]
        return None

    return write_moe(model, folder, out, "granitemoe", keys, transform, metadata=metadata)


def _granite(tmp: Path, shared: int = 0, **extra: Any) -> tuple[Any, Path]:
    import transformers as tf

    fields = dict(**TINY, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                  attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=6.0, **extra)
    if shared:
        model = tf.GraniteMoeSharedForCausalLM(tf.GraniteMoeSharedConfig(**fields, shared_intermediate_size=shared))
    else:
        model = tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(**fields))
    return built(tmp, "granitemoe", model)


@pytest.mark.parametrize("shared", [0, 48])
def test_granite_moe_reads_back_as_its_checkpoint(tmp_path: Path, shared: int) -> None:
    hf, folder = _granite(tmp_path, shared, tie_word_embeddings=True)
    assert read_back(hf, write_granitemoe(hf, folder, tmp_path / "granitemoe.gguf")) <= 1e-4


def test_granite_moe_with_biases_and_its_own_head(tmp_path: Path) -> None:
    hf, folder = _granite(tmp_path, attention_bias=True, tie_word_embeddings=False)
    assert read_back(hf, write_granitemoe(hf, folder, tmp_path / "granitemoe.gguf")) <= 1e-4


def test_granite_moe_rotating_a_part_of_each_head_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _granite(tmp_path)
    path = write_granitemoe(hf, folder, tmp_path / "granitemoe.gguf", metadata={"granitemoe.rope.dimension_count": 8})
    with pytest.raises(UnsupportedModelError, match="rope.dimension_count"):
        load(resolve(str(path)))
