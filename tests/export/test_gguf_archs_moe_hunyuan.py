"""Hunyuan-A13B GGUF files as llama.cpp's `HunYuanMoEModel` writes them, read back to the logits of the
checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_hunyuan_moe(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys, then the experts' count, the shared MLP's width (intermediate_size), the experts' width,
    top-k and shared count (the checkpoint's per-layer lists' one value); "dynamic" NTK-alpha rotary as the base
    x alpha^(d / (d - 2)) (d: hidden / heads), scaling type none, factor 1, 256k original and model context; the
    tensors under gguf's names, the experts stacked, a tied head left out."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        import gguf

        text_keys(w, h)
        w.add_expert_count(h["num_experts"])
        w.add_expert_shared_feed_forward_length(h["intermediate_size"])
        w.add_expert_feed_forward_length(h.get("moe_intermediate_size", [h["intermediate_size"]])[0])
        w.add_expert_used_count(h["moe_topk"])
        w.add_expert_shared_count(h.get("num_shared_expert", [1])[0])
        rope = h.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type")) == "dynamic":
            alpha, base = rope.get("alpha", 1000), rope.get("rope_theta", 10000.0)
            dim = h["hidden_size"] // h["num_attention_heads"]
            w.add_rope_freq_base(base * (alpha ** (dim / (dim - 2))))
            w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
            w.add_rope_scaling_factor(1)
            w.add_rope_scaling_orig_ctx_len(256 * 1024)
            w.add_context_length(256 * 1024)

    return write_moe(model, folder, out, "hunyuan-moe", keys, metadata=metadata)


def _hunyuan(tmp: Path, tied: bool = False) -> tuple[Any, Path]:
    """Hunyuan-A13B's form: NTK-alpha rotary (alpha 1000), q / k norms after the rotary, a shared MLP beside the
    experts, as wide as them; an untied head (the tied one of its smaller kin too)."""
    import transformers as tf

    config = tf.HunYuanMoEV1Config(**TINY, head_dim=16, num_experts=8, moe_topk=3, tie_word_embeddings=tied,
                                   rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "rope_theta": 10000.0,
                                                    "factor": 1.0})
    return built(tmp, "hunyuan_v1_moe", tf.HunYuanMoEV1ForCausalLM(config))


@pytest.mark.parametrize("tied", [False, True])
def test_hunyuan_moe_reads_back_as_its_checkpoint(tmp_path: Path, tied: bool) -> None:
    hf, folder = _hunyuan(tmp_path, tied)
    assert read_back(hf, write_hunyuan_moe(hf, folder, tmp_path / "hunyuan.gguf")) <= 1e-4


def test_hunyuan_moe_experts_narrower_than_the_mlp_are_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _hunyuan(tmp_path)
    path = write_hunyuan_moe(hf, folder, tmp_path / "hunyuan.gguf",
                             metadata={"hunyuan-moe.expert_feed_forward_length": 48})
    with pytest.raises(UnsupportedModelError, match="expert_feed_forward_length"):
        load(resolve(str(path)))
