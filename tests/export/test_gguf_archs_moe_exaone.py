"""K-EXAONE GGUF files as llama.cpp's `ExaoneMoEModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_exaone_moe(model: Any, folder: Path, out: Path, nextn: int = 1,
                     metadata: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys (the checkpoint's `scoring_func` sigmoid as the gating function) with `nextn` MTP layers
    counted in the blocks (their tensors after the model's), `Exaone4Model`'s vocabulary size, window and per-layer
    pattern (from `layer_types`), the experts' width / shared count / shared width, weights' scale and norm, leading
    dense layers, `nextn_predict_layers`, no rotary scaling; the selection bias as `exp_probs_b.bias`, the experts
    stacked, everything else as it is."""
    c = model.config
    rng = np.random.default_rng(0)
    h_ = c.hidden_size

    def keys(w: Any, h: dict[str, Any]) -> None:
        import gguf

        text_keys(w, {**h, "num_hidden_layers": h["num_hidden_layers"] + nextn, "scoring_func": "sigmoid"})
        w.add_vocab_size(h["vocab_size"])
        w.add_sliding_window(h["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in h["layer_types"]])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_shared_count(h["num_shared_experts"])
        w.add_expert_shared_feed_forward_length(h["moe_intermediate_size"] * h["num_shared_experts"])
        w.add_expert_weights_scale(h["routed_scaling_factor"])
        w.add_expert_weights_norm(h["norm_topk_prob"])
        w.add_leading_dense_block_count(h["first_k_dense_replace"])
        w.add_nextn_predict_layers(nextn)
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        for n in range(c.num_hidden_layers, c.num_hidden_layers + nextn):  # (the MTP layer: llama.cpp skips it)
            for name, shape in (("attn_norm.weight", (h_,)), ("attn_q.weight", (h_, h_)),
                                ("ffn_up.weight", (c.intermediate_size, h_)), ("nextn.eh_proj.weight", (h_, 2 * h_)),
                                ("nextn.enorm.weight", (h_,)), ("nextn.hnorm.weight", (h_,))):
                w.add_tensor(f"blk.{n}.{name}", rng.standard_normal(shape).astype(np.float32))

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        if name.endswith("e_score_correction_bias"):
            return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", values)]
        return None

    return write_moe(model, folder, out, "exaone-moe", keys, transform, metadata=metadata)


def _exaone_moe(tmp: Path, shared: int = 1, tied: bool = False) -> tuple[Any, Path]:
    """K-EXAONE's form: 3 sliding layers then a full one (no rotary on it), the first layer dense, a shared expert,
    sigmoid routing with a selection bias, renormalized and scaled by 2.5; q / k norms."""
    import torch
    import transformers as tf

    config = tf.ExaoneMoeConfig(**{**TINY, "num_hidden_layers": 5}, head_dim=16, num_experts=8, num_experts_per_tok=3,
                                moe_intermediate_size=24, num_shared_experts=shared, first_k_dense_replace=1,
                                sliding_window=16, sliding_window_pattern=4, norm_topk_prob=True,
                                routed_scaling_factor=2.5, tie_word_embeddings=tied,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = tf.ExaoneMoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    return built(tmp, f"exaone_moe_{shared}_{tied}", model)


@pytest.mark.parametrize(("shared", "tied", "nextn"), [(1, False, 1), (2, True, 0)])
def test_exaone_moe_reads_back_as_its_checkpoint(tmp_path: Path, shared: int, tied: bool, nextn: int) -> None:
    hf, folder = _exaone_moe(tmp_path, shared, tied)
    assert hf.config.layer_types == ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"]
    path = write_exaone_moe(hf, folder, tmp_path / "exaone_moe.gguf", nextn=nextn)
    assert read_back(hf, path) <= 1e-4


def test_exaone_moe_mtp_layers_are_left_out(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _exaone_moe(tmp_path)
    model = load(resolve(str(write_exaone_moe(hf, folder, tmp_path / "exaone_moe.gguf")))).model
    assert model.config.num_hidden_layers == 5 and len(model.model.layers) == 5


@pytest.mark.parametrize(("key", "value", "match"), [
    ("exaone-moe.expert_gating_func", 1, "expert_gating_func"),
    ("exaone-moe.attention.sliding_window_pattern", [True, False, True, False, True], "sliding_window_pattern")])
def test_exaone_moe_variants_llmc_cannot_express_are_refused(tmp_path: Path, key: str, value: Any, match: str) -> None:
    hf, folder = _exaone_moe(tmp_path)
    path = write_exaone_moe(hf, folder, tmp_path / "exaone_moe.gguf", metadata={key: value})
    with pytest.raises(UnsupportedModelError, match=match):
        read_back(hf, path)
