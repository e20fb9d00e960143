"""ERNIE 4.5 MoE GGUF files as llama.cpp's `Ernie4_5MoeModel` writes them, read back to the logits of the
checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_ernie4_5_moe(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys, then the experts' count and top-k, the MoE layers' step and first one, their width, the
    shared experts' count and width (intermediate_size // KV heads); the selection bias (`moe_statics`) as
    `exp_probs_b.bias`, the experts stacked."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, h)
        w.add_expert_count(h["moe_num_experts"])
        w.add_expert_used_count(h["moe_k"])
        w.add_interleave_moe_layer_step(h["moe_layer_interval"])
        w.add_leading_dense_block_count(h["moe_layer_start_index"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_shared_count(h["moe_num_shared_experts"])
        if h["moe_num_shared_experts"] > 0:
            w.add_expert_shared_feed_forward_length(h["intermediate_size"] // h["num_key_value_heads"])

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        if name.endswith("e_score_correction_bias"):
            return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", values)]
        return None

    return write_moe(model, folder, out, "ernie4_5-moe", keys, transform, metadata=metadata)


def _ernie(tmp: Path, layers: int = 3, interval: int = 1, shared: int = 2, **extra: Any) -> tuple[Any, Path]:
    """ERNIE-4.5-21B-A3B's form: a tied head, the first layer dense, two shared experts (intermediate_size // KV
    heads wide together), the selection bias; `extra`: a head size of its own (written as `key_length`)."""
    import torch
    import transformers as tf

    config = tf.Ernie4_5_MoeConfig(**{**TINY, "num_hidden_layers": layers}, moe_num_experts=8, moe_k=3,
                                   moe_intermediate_size=24, moe_num_shared_experts=shared, moe_layer_start_index=1,
                                   moe_layer_interval=interval, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **extra)
    model = tf.Ernie4_5_MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.moe_statics.e_score_correction_bias.copy_(torch.rand(1, 8) * 0.3)
    return built(tmp, "ernie4_5_moe", model)


@pytest.mark.parametrize("form", [dict(), dict(layers=4, interval=2), dict(shared=0), dict(head_dim=24)])
def test_ernie4_5_moe_reads_back_as_its_checkpoint(tmp_path: Path, form: dict[str, Any]) -> None:
    hf, folder = _ernie(tmp_path, **form)
    assert read_back(hf, write_ernie4_5_moe(hf, folder, tmp_path / "ernie.gguf")) <= 1e-4


def test_ernie4_5_moe_shared_width_apart_from_the_experts_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _ernie(tmp_path)
    path = write_ernie4_5_moe(hf, folder, tmp_path / "ernie.gguf",
                              metadata={"ernie4_5-moe.expert_shared_feed_forward_length": 40})
    with pytest.raises(UnsupportedModelError, match="expert_shared_feed_forward_length"):
        load(resolve(str(path)))
