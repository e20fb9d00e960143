"""MiMo-V2-Flash GGUF files as llama.cpp's `MimoV2Model` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe

NEXTN = 3  # (the converter's fixed count of MTP blocks)


def write_mimo2(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                leave_out: tuple[str, ...] = (), value_scale: bool = True) -> Path:
    """`TextModel`'s keys with the 3 MTP blocks counted in `block_count` (their tensors after the model's, as the
    converter renames `model.mtp.layers.{i}`), per-layer KV heads (the sliding layers' twice the full layers'), the
    window and the layer pattern with the MTP blocks marked sliding, the values' width, the experts' count and
    width, the rotated dims, the full and sliding rotary bases, `attention.value_scale` (the checkpoint's, unless
    `value_scale` is off); sinks as `attn_sinks.weight`, the selection bias as `exp_probs_b.bias`, the experts
    stacked."""
    c = model.config
    n, sliding = c.num_hidden_layers, [t == "sliding_attention" for t in c.layer_types]
    rng = np.random.default_rng(0)

    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, {**h, "num_hidden_layers": n + NEXTN})
        pattern = sliding + [True] * NEXTN
        w.add_head_count_kv([2 * c.num_key_value_heads if s else c.num_key_value_heads for s in pattern])
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern(pattern)
        w.add_value_length(c.v_head_dim)
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        rope = c.rope_parameters
        w.add_rope_dimension_count(int(c.head_dim * rope["full_attention"]["partial_rotary_factor"]))
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_layer_norm_rms_eps(h.get("layernorm_epsilon", 1e-5))
        if value_scale:
            w.add_float32("mimo2.attention.value_scale", c.attention_value_scale)
        w.add_nextn_predict_layers(NEXTN)
        e, h_, q, kv = c.n_routed_experts, c.hidden_size, c.num_attention_heads, 2 * c.num_key_value_heads
        for b in range(n, n + NEXTN):  # (llama.cpp loads the MTP blocks and never runs them)
            for name, shape in (("attn_norm.weight", (h_,)), ("attn_q.weight", (q * c.head_dim, h_)),
                                ("attn_k.weight", (kv * c.head_dim, h_)), ("attn_sinks.weight", (q,)),
                                ("ffn_gate_inp.weight", (e, h_)), ("exp_probs_b.bias", (e,))):
                w.add_tensor(f"blk.{b}.{name}", rng.standard_normal(shape).astype(np.float32))

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
        if name.endswith("self_attn.sinks"):
            return [(f"{blk}.attn_sinks.weight", values)]
        if name.endswith("e_score_correction_bias"):
            return [(f"{blk}.exp_probs_b.bias", values)]
        return None

    return write_moe(model, folder, out, "mimo2", keys, transform, metadata=metadata, leave_out=leave_out)


def _mimo2(tmp: Path, value_scale: float = 0.707) -> tuple[Any, Path]:
    """MiMo-V2-Flash's form at a tiny size: a full layer first and every 4th, sliding layers with twice its KV
    heads and a sink per head, values narrower than q / k, a third of each head rotated at a base per layer
    kind, the first layer dense and the rest mixtures routed by sigmoid with a selection bias."""
    import torch
    import transformers as tf

    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    config = tf.MiMoV2FlashConfig(
        **{**TINY, "num_hidden_layers": 5, "num_key_value_heads": 1}, head_dim=24, v_head_dim=16, sliding_window=8,
        layer_types=types, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        attention_value_scale=value_scale,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": 0.334}})
    model = tf.MiMoV2FlashForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
        for layer, kind in zip(model.model.layers, types, strict=True):
            if kind == "sliding_attention":
                layer.self_attn.sinks.copy_(torch.randn(4))
    return built(tmp, f"mimo2_{value_scale}", model)


def test_mimo2_reads_back_as_its_checkpoint(tmp_path: Path) -> None:
    hf, folder = _mimo2(tmp_path)
    assert read_back(hf, write_mimo2(hf, folder, tmp_path / "mimo2.gguf")) <= 1e-4


def test_mimo2_without_a_value_scale_or_a_selection_bias_reads_back(tmp_path: Path) -> None:
    """No `attention.value_scale` is none (llama.cpp's), and a layer without `exp_probs_b` selects by the scores
    alone (the tensor is optional in llama.cpp): the checkpoint with scale 1 and a zero bias there."""
    import torch

    hf, folder = _mimo2(tmp_path, value_scale=1.0)
    with torch.no_grad():
        hf.model.layers[2].mlp.gate.e_score_correction_bias.zero_()
    path = write_mimo2(hf, folder, tmp_path / "mimo2.gguf", leave_out=("blk.2.exp_probs_b.bias",), value_scale=False)
    assert read_back(hf, path) <= 1e-4


@pytest.mark.parametrize(("metadata", "leave_out", "match"), [
    ({"mimo2.attention.head_count_kv": [1, 1, 2, 1, 2, 2, 2, 2]}, (), "head_count_kv"),
    ({}, ("blk.1.attn_sinks.weight",), "sinks"),
    ({"mimo2.rope.dimension_count": 7}, (), "rope.dimension_count")])
def test_mimo2_variants_llmc_cannot_express_are_refused(tmp_path: Path, metadata: dict[str, Any],
                                                        leave_out: tuple[str, ...], match: str) -> None:
    hf, folder = _mimo2(tmp_path)
    path = write_mimo2(hf, folder, tmp_path / "mimo2.gguf", metadata=metadata, leave_out=leave_out)
    with pytest.raises(UnsupportedModelError, match=match):
        read_back(hf, path)
