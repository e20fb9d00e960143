"""SmolLM3 (`smollm3`) and Arcee AFM (`arcee`) GGUF files written as llama.cpp's `SmolLM3Model` / `ArceeModel` (both
`LlamaModel`s) write them, read back by llmc (gguf_archs/dense_llama_llamamodel) to the logits of the checkpoint
they came from."""

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


def write_llamamodel(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys (the head size where the config has one; yarn's from the rotary parameters), then
    `LlamaModel`'s: the vocabulary size, the rotated dims (the head); Arcee's yarn type, factor and original
    context again; q / k rows (and biases) permuted; the head left out where tied."""
    import gguf

    c = model.config
    arch = c.model_type
    rope = dict(c.rope_parameters)
    head = c.to_dict().get("head_dim")
    w = gguf.GGUFWriter(str(out), arch)
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
    if arch == "arcee" and rope.get("rope_type") == "yarn":  # (ArceeModel's own, over the base's)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, arch, permute_qk(c))
    _finish(w, (), metadata)
    return out


def _smollm3(tmp: Path) -> tuple[Any, Path]:
    import transformers as tf

    config = tf.SmolLM3Config(**{**TINY, "num_hidden_layers": 5}, tie_word_embeddings=True)
    assert config.no_rope_layers == [1, 1, 1, 0, 1]
    return built(tmp, "smollm3", tf.SmolLM3ForCausalLM(config))


def _arcee(tmp: Path, **extra: Any) -> tuple[Any, Path]:
    import transformers as tf

    return built(tmp, "arcee", tf.ArceeForCausalLM(tf.ArceeConfig(**TINY, hidden_act="relu2", **extra)))


_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
CASES = {"smollm3": lambda tmp: _smollm3(tmp),
         "arcee": lambda tmp: _arcee(tmp),
         "arcee (yarn, biases, head size)": lambda tmp: _arcee(tmp, rope_parameters=_YARN, attention_bias=True,
                                                              head_dim=32)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_llamamodel_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    hf, folder = CASES[name](tmp_path)
    hf.set_attn_implementation("eager")
    assert read_back(hf, write_llamamodel(hf, folder, tmp_path / "model.gguf")) <= 1e-4


def test_smollm3_skips_rotary_on_every_fourth_layer(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _smollm3(tmp_path)
    ours = load(resolve(str(write_llamamodel(hf, folder, tmp_path / "model.gguf")))).model
    assert ours.config.no_rope_layers == [1, 1, 1, 0, 1]


def test_a_partly_rotated_head_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _smollm3(tmp_path)
    path = write_llamamodel(hf, folder, tmp_path / "model.gguf", metadata={"smollm3.rope.dimension_count": 8})
    with pytest.raises(UnsupportedModelError, match="rope.dimension_count 8"):
        load(resolve(str(path)))
