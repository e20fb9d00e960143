"""Ministral 3 GGUF files (`mistral3`) written as llama.cpp's `Mistral3Model.Ministral3Model` (a `LlamaModel`) writes
them, read back by llmc (gguf_archs/dense_llama_mistral3) to the logits of the checkpoint they came from: Ministral 3's yarn,
its yarn log multiplier and Llama 4 attention temperature; the text of a Mistral Small 3.x checkpoint (no scaling,
no temperature), which the same converter writes as `mistral3`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import (
    TINY,
    _finish,
    _tokenizer,
    add_tensors,
    add_text_keys,
    add_yarn_keys,
    built,
    permute_qk,
    read_back,
)

from llmc.errors import UnsupportedModelError


def write_mistral3(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                   more: dict[str, float] | None = None) -> Path:
    """`TextModel`'s keys (yarn's type, factor, original context and betas from the rotary parameters; the head size
    where the config has one), `LlamaModel`'s (the vocabulary size, the rotated dims: the head), then for a
    `ministral3` config `Ministral3Model`'s: `mscale_all_dim` as the yarn log multiplier, `llama_4_scaling_beta` as
    the attention temperature; q / k rows permuted; the head left out where tied. `metadata` replaces keys' values,
    `more` adds float keys (the files llmc must refuse)."""
    import gguf

    c = model.config
    rope = dict(c.rope_parameters)
    head = c.to_dict().get("head_dim")
    w = gguf.GGUFWriter(str(out), "mistral3")
    add_text_keys(w, c)
    if rope.get("rope_type") == "yarn":
        add_yarn_keys(w, rope)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if head is not None:
        w.add_key_length(head)
        w.add_value_length(head)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(head or c.hidden_size // c.num_attention_heads)
    if c.model_type == "ministral3":
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    for key, value in (more or {}).items():
        w.add_float32(key, value)
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, gguf.MODEL_ARCH.MISTRAL3, permute_qk(c))
    _finish(w, (), metadata)
    return out


def _yarn(mscale_all_dim: float, beta: float) -> dict[str, Any]:
    """Ministral 3's rotary parameters (16 x yarn, mscale 1), the original context shrunk to 16 positions so that
    100 positions cross several of the temperature's steps."""
    return {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": mscale_all_dim,
            "llama_4_scaling_beta": beta}


def _ministral3(tmp: Path, tied: bool, mscale_all_dim: float = 1.0, beta: float = 0.1) -> tuple[Any, Path]:
    import transformers as tf

    config = tf.Ministral3Config(**TINY, head_dim=32, tie_word_embeddings=tied,
                                 rope_parameters=_yarn(mscale_all_dim, beta))
    return built(tmp, "ministral3", tf.Ministral3ForCausalLM(config))


def _mistral_small(tmp: Path) -> tuple[Any, Path]:
    """The text of Mistral Small 3.x (`Mistral3ForConditionalGeneration` over a `mistral` text config): no window,
    no rotary scaling, heads of 32 beside a width of 64 / 4."""
    import transformers as tf

    config = tf.MistralConfig(**TINY, head_dim=32, sliding_window=None,
                              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000_000.0})
    return built(tmp, "mistral_small", tf.MistralForCausalLM(config))


CASES = {"ministral3 3B (tied, yarn, temperature)": lambda tmp: _ministral3(tmp, tied=True),
         "ministral3 (untied, yarn log multiplier 0.7)": lambda tmp: _ministral3(tmp, tied=False, mscale_all_dim=0.7,
                                                                                 beta=0.3),
         "mistral small 3.x text (no scaling)": _mistral_small}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_mistral3_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    hf, folder = CASES[name](tmp_path)
    hf.set_attn_implementation("eager")
    assert read_back(hf, write_mistral3(hf, folder, tmp_path / "model.gguf")) <= 1e-4


def test_a_mistral3_gguf_reads_as_ministral3(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _ministral3(tmp_path, tied=True)
    ours = load(resolve(str(write_mistral3(hf, folder, tmp_path / "model.gguf")))).model
    rope = ours.config.rope_parameters
    assert ours.config.model_type == "ministral3" and ours.config.head_dim == 32 and ours.config.sliding_window is None
    assert (rope["rope_type"], rope["factor"], rope["mscale_all_dim"], rope["llama_4_scaling_beta"],
            rope["original_max_position_embeddings"]) == ("yarn", 16.0, 1.0, pytest.approx(0.1), 16)


@pytest.mark.parametrize(("metadata", "more", "match"), [
    ({"mistral3.rope.dimension_count": 16}, {}, "rope.dimension_count 16"),
    ({"mistral3.rope.scaling.type": "longrope"}, {}, "rope.scaling.type 'longrope'"),
    ({}, {"mistral3.rope.scaling.attn_factor": 1.5}, "rope.scaling.attn_factor 1.5"),
    ({}, {"mistral3.rope.scaling.yarn_ext_factor": 0.5}, "yarn_ext_factor 0.5"),
    ({}, {"mistral3.attention.scale": 0.25}, "attention.scale 0.25"),
])
def test_a_mistral3_gguf_llmc_cannot_express_is_refused(tmp_path: Path, metadata: dict[str, Any],
                                                        more: dict[str, float], match: str) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _ministral3(tmp_path, tied=True)
    path = write_mistral3(hf, folder, tmp_path / "model.gguf", metadata=metadata, more=more)
    with pytest.raises(UnsupportedModelError, match=match):
        load(resolve(str(path)))
