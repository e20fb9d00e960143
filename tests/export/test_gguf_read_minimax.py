"""MiniMax-M2 GGUF files (transformers reads this family itself) as llama.cpp's `MiniMaxM2Model` writes them, read
back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf_files import TINY, built, read_back

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_minimax_m2(model: Any, folder: Path, out: Path) -> Path:
    """`TextModel`'s keys (sigmoid gating from `scoring_func`), the experts' width (`intermediate_size`) and the
    rotated dims (the checkpoint's `rotary_dim`: the head size x its partial rotary factor); the full-width q / k
    norms as they are, the selection bias as `exp_probs_b.bias`, the experts stacked."""
    c = model.config

    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, {**h, "scoring_func": "sigmoid"})
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        if name.endswith("e_score_correction_bias"):
            return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", values)]
        return None

    return write_moe(model, folder, out, "minimax-m2", keys, transform)


def test_minimax_m2_reads_back_as_its_checkpoint(tmp_path: Path) -> None:
    """Half of each head rotated, q / k norms over the whole projection, sigmoid routing with a selection bias and
    the chosen weights renormalized."""
    import torch
    import transformers as tf

    config = tf.MiniMaxM2Config(**{**TINY, "num_hidden_layers": 3, "intermediate_size": 24}, head_dim=16,
                                num_local_experts=8, num_experts_per_tok=2,
                                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5})
    model = tf.MiniMaxM2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    hf, folder = built(tmp_path, "minimax_m2", model)
    assert read_back(hf, write_minimax_m2(hf, folder, tmp_path / "minimax.gguf")) <= 1e-4
