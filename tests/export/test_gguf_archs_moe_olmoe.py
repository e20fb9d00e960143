"""OLMoE GGUF files as llama.cpp's `OlmoeModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf_files import TINY, built, read_back

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_olmoe(model: Any, folder: Path, out: Path) -> Path:
    """`TextModel`'s keys, RMS epsilon 1e-5 over the checkpoint's; the tensors under gguf's names (q / k not
    permuted), the experts stacked per projection."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, h)
        w.add_layer_norm_rms_eps(1e-5)

    return write_moe(model, folder, out, "olmoe", keys)


def test_olmoe_reads_back_as_its_checkpoint(tmp_path: Path) -> None:
    import transformers as tf

    config = tf.OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, rms_norm_eps=1e-5)
    hf, folder = built(tmp_path, "olmoe", tf.OlmoeForCausalLM(config))
    assert read_back(hf, write_olmoe(hf, folder, tmp_path / "olmoe.gguf")) <= 1e-4
