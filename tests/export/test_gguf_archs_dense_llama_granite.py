"""Granite GGUF files written as llama.cpp's `GraniteModel` (Granite 3.x) and `GraniteHybridModel` (Granite 4.0's
dense models, written as `granite`) write them, read back by llmc (gguf_archs/dense_llama_granite) to the logits of
the checkpoint they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import (
    TINY,
    _finish,
    _tokenizer,
    add_keys,
    add_tensors,
    add_text_keys,
    built,
    permute_qk,
    read_back,
)

from llmc.errors import UnsupportedModelError


def write_granite(model: Any, folder: Path, out: Path, hybrid: bool = False,
                  metadata: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys without the head size (popped), `LlamaModel`'s vocabulary size and rotated dims (width /
    heads), the multipliers as `attention.scale`, `embedding_scale`, `residual_scale`, `logit_scale`; q / k rows
    (and biases) permuted; the head left out where tied. `hybrid`: as `GraniteHybridModel` writes a Granite 4.0
    dense model (all attention layers): its Mamba keys too, the KV heads per layer, `rope.scaling.finetuned` true."""
    import gguf

    c = model.config
    n = c.num_hidden_layers
    w = gguf.GGUFWriter(str(out), "granite")
    add_text_keys(w, c, rope_freq_base=c.rope_parameters["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps,
                  file_type=gguf.LlamaFileType.ALL_F32, vocab_size=c.vocab_size,
                  rope_dimension_count=c.hidden_size // c.num_attention_heads,
                  attention_scale=c.attention_multiplier, embedding_scale=c.embedding_multiplier,
                  residual_scale=c.residual_multiplier, logit_scale=c.logits_scaling)
    if hybrid:
        add_keys(w, ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=1, ssm_inner_size=2 * c.hidden_size,
                 ssm_time_step_rank=8, head_count_kv=[c.num_key_value_heads] * n, rope_scaling_finetuned=True)
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, gguf.MODEL_ARCH.GRANITE, permute_qk(c))
    _finish(w, (), metadata)
    return out


def _granite(tmp: Path, **extra: Any) -> tuple[Any, Path]:
    import transformers as tf

    config = {**dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.25,
                     logits_scaling=2.5, tie_word_embeddings=True), **extra}
    return built(tmp, "granite", tf.GraniteForCausalLM(tf.GraniteConfig(**TINY, **config)))


CASES = {"granite 3.x (tied)": (lambda tmp: _granite(tmp), {}),
         "granite (untied, biases)": (lambda tmp: _granite(tmp, tie_word_embeddings=False, attention_bias=True,
                                                           mlp_bias=True), {}),
         "granite 4.0 dense (hybrid converter)": (lambda tmp: _granite(tmp), {"hybrid": True})}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_granite_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    make, options = CASES[name]
    hf, folder = make(tmp_path)
    hf.set_attn_implementation("eager")
    assert read_back(hf, write_granite(hf, folder, tmp_path / "model.gguf", **options)) <= 1e-4


@pytest.mark.parametrize("metadata, match", [({"granite.rope.scaling.finetuned": False}, "finetuned"),
                                             ({"granite.attention.head_count_kv": [2, 4]}, "differs between layers")])
def test_a_granite_file_llmc_cannot_read_faithfully_is_refused(tmp_path: Path, metadata: dict[str, Any],
                                                               match: str) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _granite(tmp_path)
    path = write_granite(hf, folder, tmp_path / "model.gguf", hybrid=True, metadata=metadata)
    with pytest.raises(UnsupportedModelError, match=match):
        load(resolve(str(path)))
