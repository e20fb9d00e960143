"""Seed-OSS GGUF files written as llama.cpp's `SeedOssModel` writes them, read back by llmc
(gguf_archs/dense_llama_seed_oss) to the logits of the checkpoint they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import TINY, _finish, _tokenizer, add_tensors, add_text_keys, built, read_back


def write_seed_oss(model: Any, folder: Path, out: Path) -> Path:
    """`TextModel`'s keys only (the head size as `key_length`); no tensor reordered; the head left out where tied."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(out), "seed_oss")
    add_text_keys(w, c, rope_freq_base=c.rope_parameters["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps,
                  key_length=c.head_dim, value_length=c.head_dim, file_type=gguf.LlamaFileType.ALL_F32)
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, gguf.MODEL_ARCH.SEED_OSS)
    _finish(w, (), None)
    return out


def _seed_oss(tmp: Path, **extra: Any) -> tuple[Any, Path]:
    import transformers as tf

    return built(tmp, "seed_oss", tf.SeedOssForCausalLM(tf.SeedOssConfig(**TINY, head_dim=32, **extra)))


CASES = {"seed-oss (q / k / v biases)": dict(attention_bias=True, attention_out_bias=False),
         "seed-oss (o bias too, tied)": dict(attention_bias=True, attention_out_bias=True, tie_word_embeddings=True)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_seed_oss_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    hf, folder = _seed_oss(tmp_path, **CASES[name])
    hf.set_attn_implementation("eager")
    assert read_back(hf, write_seed_oss(hf, folder, tmp_path / "model.gguf")) <= 1e-4
