"""Command A MoE (Cohere 2 MoE) GGUF files as llama.cpp's `Cohere2MoeModel` writes them, read back to the logits of the
checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_cohere2moe(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                     leave_out: tuple[str, ...] = ()) -> Path:
    """`TextModel`'s keys, the logit scale, the window, the layer pattern as booleans, the vocabulary size, the
    experts' width, the leading dense layers, `norm_topk_prob`, sigmoid gating (whatever the checkpoint's), the
    shared experts' count and width, the head size rotated; the experts stacked, zero biases dropped, the rest by
    GLM-4.5's name table (gguf's package has none for `cohere2moe`)."""
    import gguf

    c = model.config

    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, h)
        w.add_logit_scale(c.logit_scale)
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        w.add_vocab_size(c.vocab_size)
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_leading_dense_block_count(c.mlp_layer_types.index("sparse"))
        w.add_expert_weights_norm(bool(c.norm_topk_prob))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if c.num_shared_experts:
            w.add_expert_shared_count(c.num_shared_experts)
            w.add_expert_shared_feed_forward_length(c.intermediate_size * c.num_shared_experts)
        w.add_rope_dimension_count(c.head_dim)

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        return [] if name.endswith(".bias") else None

    return write_moe(model, folder, out, "cohere2moe", keys, transform, metadata=metadata, leave_out=leave_out,
                     table="glm4moe")


def _cohere2moe(tmp: Path, shared: int = 1, rms: bool = False, selection: str = "sigmoid") -> tuple[Any, Path]:
    """Command A MoE's form at a tiny size: a dense full first layer (rotated all the same), three sliding layers
    then a full one (unrotated), top-2 routing renormalized, a shared expert averaged in, the logits scaled;
    LayerNorms or RMS norms."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "cohere2_moe", **{**TINY, "num_hidden_layers": 5, "intermediate_size": 24}, head_dim=16, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=shared, expert_selection_fn=selection, norm_topk_prob=True,
        sliding_window=8, logit_scale=0.25,
        layer_types=["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 4, prefix_dense_sliding_window_pattern=1,
        **({"rms_norm_eps": 1e-5} if rms else {}), rope_parameters={"rope_type": "default", "rope_theta": 5e4})
    return built(tmp, f"cohere2moe_{shared}_{rms}_{selection}", AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize(("shared", "rms"), [(1, False), (0, True)])
def test_cohere2moe_reads_back_as_its_checkpoint(tmp_path: Path, shared: int, rms: bool) -> None:
    hf, folder = _cohere2moe(tmp_path, shared, rms)
    assert read_back(hf, write_cohere2moe(hf, folder, tmp_path / "c.gguf")) <= 1e-4


def test_cohere2moe_softmax_gating_renormalized_is_the_checkpoint_s_softmax(tmp_path: Path) -> None:
    """llama.cpp's softmax over every expert, renormalized over the chosen ones, is transformers' softmax of the
    chosen experts' logits."""
    hf, folder = _cohere2moe(tmp_path, selection="softmax")
    path = write_cohere2moe(hf, folder, tmp_path / "c.gguf", metadata={"cohere2moe.expert_gating_func": 1})
    assert read_back(hf, path) <= 1e-4


@pytest.mark.parametrize(("metadata", "leave_out", "match"), [
    ({"cohere2moe.expert_gating_func": 1, "cohere2moe.expert_weights_norm": False}, (), "expert_gating_func"),
    ({"cohere2moe.expert_shared_feed_forward_length": 36}, (), "expert_shared_feed_forward_length"),
    ({"cohere2moe.rope.dimension_count": 8}, (), "rope.dimension_count")])
def test_cohere2moe_variants_llmc_cannot_express_are_refused(tmp_path: Path, metadata: dict[str, Any],
                                                             leave_out: tuple[str, ...], match: str) -> None:
    hf, folder = _cohere2moe(tmp_path)
    path = write_cohere2moe(hf, folder, tmp_path / "c.gguf", metadata=metadata, leave_out=leave_out)
    with pytest.raises(UnsupportedModelError, match=match):
        read_back(hf, path)
