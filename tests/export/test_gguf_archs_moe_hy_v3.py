"""Hy3 (HY V3) GGUF files as llama.cpp's `HYV3Model` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_hy_v3(model: Any, folder: Path, out: Path, nextn: int = 1, metadata: dict[str, Any] | None = None,
                leave_out: tuple[str, ...] = ()) -> Path:
    """`TextModel`'s keys with `nextn` MTP blocks counted in `block_count` (their tensors after the model's), the
    experts' and shared experts' widths, `route_norm` (true) and `router_scaling_factor`, sigmoid gating; the
    selection bias as `exp_probs_b` (no `.bias`: the converter's table maps the checkpoint's bare name so), the
    experts stacked, the rest by GLM-4.5's name table (gguf's package has none for `hy_v3`)."""
    import gguf

    c = model.config
    rng = np.random.default_rng(0)

    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, {**h, "num_hidden_layers": h["num_hidden_layers"] + nextn})
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(h["moe_intermediate_size"] * h["num_shared_experts"])
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(h["router_scaling_factor"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if nextn:
            w.add_nextn_predict_layers(nextn)
        h_ = c.hidden_size
        for b in range(c.num_hidden_layers, c.num_hidden_layers + nextn):  # (llama.cpp loads them, never runs them)
            for name, shape in (("attn_norm.weight", (h_,)), ("nextn.eh_proj.weight", (h_, 2 * h_)),
                                ("nextn.enorm.weight", (h_,)), ("nextn.hnorm.weight", (h_,))):
                w.add_tensor(f"blk.{b}.{name}", rng.standard_normal(shape).astype(np.float32))

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        if name.endswith("mlp.e_score_correction_bias"):
            return [(f"blk.{name.split('.')[2]}.exp_probs_b", values)]
        return None

    return write_moe(model, folder, out, "hy_v3", keys, transform, metadata=metadata, leave_out=leave_out,
                     table="glm4moe")


def _hy_v3(tmp: Path, shared: int = 1) -> tuple[Any, Path]:
    """Hy3's form: the first layer dense, q / k norms per head, sigmoid routing with a selection bias, renormalized
    and scaled, shared experts beside."""
    import torch
    import transformers as tf
    from transformers import AutoConfig

    config = AutoConfig.for_model("hy_v3", **{**TINY, "num_hidden_layers": 3}, head_dim=16, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=24, num_shared_experts=shared,
                                  router_scaling_factor=2.826, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    return built(tmp, f"hy_v3_{shared}", model)


@pytest.mark.parametrize("shared", [1, 2])
def test_hy_v3_reads_back_as_its_checkpoint(tmp_path: Path, shared: int) -> None:
    hf, folder = _hy_v3(tmp_path, shared)
    assert hf.config.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert read_back(hf, write_hy_v3(hf, folder, tmp_path / "hy.gguf")) <= 1e-4


@pytest.mark.parametrize(("metadata", "leave_out", "match"), [
    ({"hy_v3.expert_gating_func": 1}, (), "expert_gating_func"),
    ({"hy_v3.expert_weights_norm": False}, (), "expert_weights_norm"),
    ({}, ("hy_v3.expert_weights_norm",), "expert_weights_norm"),
    ({"hy_v3.expert_shared_feed_forward_length": 36}, (), "expert_shared_feed_forward_length")])
def test_hy_v3_variants_llmc_cannot_express_are_refused(tmp_path: Path, metadata: dict[str, Any],
                                                        leave_out: tuple[str, ...], match: str) -> None:
    hf, folder = _hy_v3(tmp_path)
    path = write_hy_v3(hf, folder, tmp_path / "hy.gguf", metadata=metadata, leave_out=leave_out)
    with pytest.raises(UnsupportedModelError, match=match):
        read_back(hf, path)
