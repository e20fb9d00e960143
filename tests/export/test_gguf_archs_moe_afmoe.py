"""Trinity (AFMoE) GGUF files as llama.cpp's `AfmoeModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_afmoe(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                leave_out: tuple[str, ...] = (), period: int | None = None) -> Path:
    """`TextModel`'s keys (the checkpoint's `score_func` sigmoid as the gating function), `LlamaModel`'s vocabulary
    size and rotated dims (the head size), the experts' shared count / width, the leading dense layers, the
    checkpoint's `route_norm` (true) and `route_scale`, the window; the selection bias renamed `expert_bias.bias`
    (`exp_probs_b.bias`), the experts stacked, q / k as they are; `period`: a scalar `sliding_window_pattern` added
    (the converter writes none)."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, {**h, "score_func": "sigmoid"})
        w.add_vocab_size(h["vocab_size"])
        w.add_rope_dimension_count(h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"])
        w.add_expert_shared_count(h["num_shared_experts"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_leading_dense_block_count(h["num_dense_layers"])
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(h["route_scale"])
        w.add_sliding_window(h["sliding_window"])
        if period is not None:
            w.add_sliding_window_pattern(period)

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        if name.endswith("mlp.expert_bias"):
            return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", values)]
        return None

    return write_moe(model, folder, out, "afmoe", keys, transform, metadata=metadata, leave_out=leave_out)


def _afmoe(tmp: Path, shared: int = 1, tied: bool = False) -> tuple[Any, Path]:
    """Trinity's form: 3 sliding (rotated) layers then a full unrotated one, the first layer dense, shared experts,
    sigmoid routing with a selection bias, renormalized and scaled, muP's embedding scale, the attention's gate."""
    import torch
    import transformers as tf

    config = tf.AfmoeConfig(**{**TINY, "num_hidden_layers": 5}, head_dim=16, num_experts=8, num_experts_per_tok=3,
                            moe_intermediate_size=24, num_shared_experts=shared, num_dense_layers=1,
                            global_attn_every_n_layers=4, sliding_window=16, route_scale=2.826, mup_enabled=True,
                            tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = tf.AfmoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.expert_bias.copy_(torch.randn(8) * 0.3)
    return built(tmp, f"afmoe_{shared}_{tied}", model)


@pytest.mark.parametrize(("shared", "tied"), [(1, False), (2, True)])
def test_afmoe_reads_back_as_its_checkpoint(tmp_path: Path, shared: int, tied: bool) -> None:
    hf, folder = _afmoe(tmp_path, shared, tied)
    assert hf.config.layer_types == ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"]
    assert read_back(hf, write_afmoe(hf, folder, tmp_path / "afmoe.gguf")) <= 1e-4


@pytest.mark.parametrize(("metadata", "leave_out", "match"), [
    ({"afmoe.expert_gating_func": 1}, (), "expert_gating_func"),
    ({"afmoe.expert_weights_norm": False}, (), "expert_weights_norm"),
    ({}, ("afmoe.attention.sliding_window",), "sliding_window"),
    ({}, ("afmoe.expert_weights_norm",), "expert_weights_norm")])
def test_afmoe_variants_llmc_cannot_express_are_refused(tmp_path: Path, metadata: dict[str, Any],
                                                        leave_out: tuple[str, ...], match: str) -> None:
    hf, folder = _afmoe(tmp_path)
    path = write_afmoe(hf, folder, tmp_path / "afmoe.gguf", metadata=metadata, leave_out=leave_out)
    with pytest.raises(UnsupportedModelError, match=match):
        read_back(hf, path)


def test_afmoe_period_other_than_four_is_refused(tmp_path: Path) -> None:
    hf, folder = _afmoe(tmp_path)
    path = write_afmoe(hf, folder, tmp_path / "afmoe.gguf", period=2)
    with pytest.raises(UnsupportedModelError, match="sliding_window_pattern"):
        read_back(hf, path)
