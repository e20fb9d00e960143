"""EXAONE 3.x and EXAONE 4.0 GGUF files (llmc/export/gguf_archs/dense_other_exaone.py) written as llama.cpp's
`ExaoneModel` / `Exaone4Model` write them, read back to the logits of the checkpoint they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import (
    TINY,
    _finish,
    _llama3_divisors,
    _tokenizer,
    add_tensors,
    add_text_keys,
    built,
    read_back,
)

from llmc.errors import UnsupportedModelError

LLAMA3 = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def write_exaone(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                 leave_out: tuple[str, ...] = ()) -> Path:
    """As `ExaoneModel` / `Exaone4Model` write them: `TextModel`'s keys (transformers' config as the converter
    reads it: the RMS epsilon as such, the head size as key / value lengths); EXAONE 3.x's rotated dims; EXAONE
    4.0's vocabulary size, window and the layer types as a pattern of booleans; a llama3 rotary as `rope_freqs`;
    the tensors as they are, no lm_head where tied. `metadata` replaces keys' values, `leave_out` drops keys."""
    import gguf

    c = model.config
    arch = "exaone4" if c.model_type == "exaone4" else "exaone"
    rope = c.rope_parameters
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(out), arch)
    add_text_keys(w, c, rope_freq_base=rope["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps)
    if getattr(c, "head_dim", None) is not None:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "exaone":
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * (c.hidden_size //
                                                                                 c.num_attention_heads)))
    else:
        w.add_vocab_size(c.vocab_size)
        if c.sliding_window is not None:
            w.add_sliding_window(c.sliding_window)
            w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    _tokenizer(w, folder, c.vocab_size)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_divisors(rope, head))
    add_tensors(w, model, arch)
    _finish(w, leave_out, metadata)
    return out


def _exaone35(tmp: Path) -> tuple[Any, Path]:  # EXAONE 3.5's form: llama3 rotary scaling, untied
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("exaone", **TINY, rope_parameters=dict(LLAMA3), tie_word_embeddings=False)
    return built(tmp, "exaone35", AutoModelForCausalLM.from_config(cfg))


def _exaone_biased(tmp: Path) -> tuple[Any, Path]:  # biases on q / k / v / output, a plain rotary, tied
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("exaone", **TINY, attention_bias=True, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return built(tmp, "exaone_biased", AutoModelForCausalLM.from_config(cfg))


def _exaone4_1b(tmp: Path) -> tuple[Any, Path]:  # EXAONE 4.0 1.2B's form: global attention, llama3, tied
    import transformers as tf

    cfg = tf.Exaone4Config(**TINY, sliding_window=None, layer_types=["full_attention"] * 2,
                           rope_parameters=dict(LLAMA3), tie_word_embeddings=True)
    return built(tmp, "exaone4_1b", tf.Exaone4ForCausalLM(cfg))


def _exaone4_32b(tmp: Path) -> tuple[Any, Path]:  # 32B's: 64 layers, 3 sliding (rotated) then 1 full (NoPE)
    import transformers as tf

    cfg = tf.Exaone4Config(**{**TINY, "num_hidden_layers": 64}, sliding_window=8, sliding_window_pattern=4,
                           rope_parameters=dict(LLAMA3), tie_word_embeddings=False)
    return built(tmp, "exaone4_32b", tf.Exaone4ForCausalLM(cfg))


CASES = {"exaone35": _exaone35, "exaone_biased": _exaone_biased, "exaone4_1b": _exaone4_1b,
         "exaone4_32b": _exaone4_32b}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_exaone_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    hf, folder = CASES[name](tmp_path)
    assert read_back(hf, write_exaone(hf, folder, tmp_path / f"{name}.gguf")) <= 1e-4


def test_an_exaone4_32b_file_without_its_pattern_slides_three_in_four(tmp_path: Path) -> None:
    hf, folder = _exaone4_32b(tmp_path)
    path = write_exaone(hf, folder, tmp_path / "no_pattern.gguf",
                        leave_out=("exaone4.attention.sliding_window_pattern",))
    assert read_back(hf, path) <= 1e-4


def test_partial_rotary_exaone_files_are_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _exaone_biased(tmp_path)
    path = write_exaone(hf, folder, tmp_path / "partial.gguf", metadata={"exaone.rope.dimension_count": 8})
    with pytest.raises(UnsupportedModelError, match="rope.dimension_count"):
        load(resolve(str(path)))
