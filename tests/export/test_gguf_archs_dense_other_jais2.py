"""Jais-2 GGUF files as llama.cpp's `Jais2Model` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_jais2(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys (the LayerNorm epsilon, the head size), the rotated dims (the head size); every tensor as
    it is, under gguf's names."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, h)
        w.add_rope_dimension_count(h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"])

    return write_moe(model, folder, out, "jais2", keys, metadata=metadata)


def _jais2(tmp: Path, tied: bool = False) -> tuple[Any, Path]:
    """Jais-2's form: LayerNorms with biases, biases on every product, ReLU squared, as many KV heads as heads."""
    import transformers as tf

    config = tf.Jais2Config(**{**TINY, "num_key_value_heads": 4}, layer_norm_eps=1e-5, tie_word_embeddings=tied,
                            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
    return built(tmp, f"jais2_{tied}", tf.Jais2ForCausalLM(config))


@pytest.mark.parametrize("tied", [False, True])
def test_jais2_reads_back_as_its_checkpoint(tmp_path: Path, tied: bool) -> None:
    hf, folder = _jais2(tmp_path, tied)
    assert read_back(hf, write_jais2(hf, folder, tmp_path / "jais2.gguf")) <= 1e-4


@pytest.mark.parametrize(("key", "value"), [("jais2.rope.dimension_count", 8), ("jais2.attention.head_count_kv", 2)])
def test_jais2_variants_llama_cpp_does_not_run_are_refused(tmp_path: Path, key: str, value: int) -> None:
    hf, folder = _jais2(tmp_path)
    path = write_jais2(hf, folder, tmp_path / "jais2.gguf", metadata={key: value})
    with pytest.raises(UnsupportedModelError, match=key.split(".", 1)[1]):
        read_back(hf, path)
