"""LFM2-MoE GGUF files as llama.cpp's `LFM2MoeModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_lfm2moe(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys with the KV heads per layer (0 on a convolution), then the experts' count and width, the
    leading dense layers, sigmoid gating, the vocabulary size, the convolutions' cache length; the convolutions'
    taps squeezed to [hidden, L], the expert bias as `exp_probs_b.bias`, the experts stacked, a tied head left
    out."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        import gguf

        kv = [h["num_key_value_heads"] if t == "full_attention" else 0 for t in h["layer_types"]]
        text_keys(w, {**h, "num_key_value_heads": kv})
        w.add_expert_count(h["num_experts"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_leading_dense_block_count(h["num_dense_layers"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_vocab_size(h["vocab_size"])
        w.add_shortconv_l_cache(h["conv_L_cache"])

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
        if "conv.conv" in name:
            return [(f"{blk}.shortconv.conv.weight", values.squeeze(1))]
        if name.endswith(".expert_bias"):
            return [(f"{blk}.exp_probs_b.bias", values)]
        return None

    return write_moe(model, folder, out, "lfm2moe", keys, transform, metadata=metadata)


def _lfm2moe(tmp: Path) -> tuple[Any, Path]:
    """LFM2-8B-A1B's form: convolutions and attention layers (q / k norms) mixed, the first layer's MLP dense, the
    expert bias, a tied head."""
    import torch
    import transformers as tf

    config = tf.Lfm2MoeConfig(**{**TINY, "num_hidden_layers": 4}, num_experts=8, num_experts_per_tok=3,
                              moe_intermediate_size=24, num_dense_layers=1, conv_L_cache=3,
                              layer_types=["conv", "full_attention", "conv", "full_attention"],
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    model = tf.Lfm2MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.feed_forward.expert_bias.copy_(torch.randn(8) * 0.3)
    return built(tmp, "lfm2_moe", model)


def test_lfm2moe_reads_back_as_its_checkpoint(tmp_path: Path) -> None:
    hf, folder = _lfm2moe(tmp_path)
    assert read_back(hf, write_lfm2moe(hf, folder, tmp_path / "lfm2moe.gguf")) <= 1e-4


def test_lfm2moe_softmax_routing_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _lfm2moe(tmp_path)
    path = write_lfm2moe(hf, folder, tmp_path / "lfm2moe.gguf", metadata={"lfm2moe.expert_gating_func": 1})
    with pytest.raises(UnsupportedModelError, match="expert_gating_func"):
        load(resolve(str(path)))
