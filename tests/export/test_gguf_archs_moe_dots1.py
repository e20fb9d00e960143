"""dots.llm1 GGUF files as llama.cpp's `Dots1Model` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_dots1(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """`Qwen2MoeModel`'s keys (`TextModel`'s, the routed experts' count, their width), then the leading dense
    layers, the shared experts' count, the weights' scale and norm, sigmoid gating (`noaux_tc`); the selection bias
    as `exp_probs_b.bias`, the shared experts under gguf's names, the routed ones stacked."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        import gguf

        text_keys(w, h)
        w.add_expert_count(h["n_routed_experts"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_leading_dense_block_count(h["first_k_dense_replace"])
        w.add_expert_shared_count(h["n_shared_experts"])
        w.add_expert_weights_scale(h["routed_scaling_factor"])
        w.add_expert_weights_norm(h["norm_topk_prob"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        if name.endswith("e_score_correction_bias"):
            return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", values)]
        return None

    return write_moe(model, folder, out, "dots1", keys, transform, metadata=metadata)


def _dots(tmp: Path, **extra: Any) -> tuple[Any, Path]:
    """dots.llm1's form: the first layer dense, two shared experts, sigmoid routing with a selection bias,
    renormalized and scaled, q / k norms, no window (the config's default window left on its layers' count)."""
    import torch
    import transformers as tf

    config = tf.Dots1Config(**{**TINY, "num_hidden_layers": 3}, n_routed_experts=8, num_experts_per_tok=3,
                            moe_intermediate_size=24, n_shared_experts=2, first_k_dense_replace=1,
                            norm_topk_prob=True, routed_scaling_factor=2.5, max_window_layers=3, **extra)
    model = tf.Dots1ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    return built(tmp, "dots1", model)


@pytest.mark.parametrize("extra", [{}, {"n_group": 4, "topk_group": 2}])
def test_dots1_reads_back_as_its_checkpoint(tmp_path: Path, extra: dict[str, Any]) -> None:
    hf, folder = _dots(tmp_path, **extra)
    assert read_back(hf, write_dots1(hf, folder, tmp_path / "dots1.gguf")) <= 1e-4


def test_dots1_softmax_routing_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _dots(tmp_path)
    path = write_dots1(hf, folder, tmp_path / "dots1.gguf", metadata={"dots1.expert_gating_func": 1})
    with pytest.raises(UnsupportedModelError, match="expert_gating_func"):
        load(resolve(str(path)))
