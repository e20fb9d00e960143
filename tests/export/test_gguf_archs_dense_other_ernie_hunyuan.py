"""ERNIE 4.5 dense and Hunyuan dense GGUF files (llmc/export/gguf_archs/dense_other_ernie_hunyuan.py) written as
llama.cpp's `Ernie4_5Model` / `HunYuanModel` write them, read back to the logits of the checkpoint they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import TINY, _finish, _tokenizer, add_keys, add_tensors, add_text_keys, built, read_back

from llmc.errors import UnsupportedModelError


def write_dense(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                extra: dict[str, Any] | None = None) -> Path:
    """As `Ernie4_5Model` / `HunYuanModel` write them: `TextModel`'s keys (the head size as key / value lengths);
    Hunyuan's NTK-alpha rotary ("dynamic" with alpha) as the stretched base, no scaling, 256k context and original
    context; the tensors as they are, no lm_head where tied. `extra`: keys added with the writer's own call."""
    import gguf

    c = model.config
    arch = "ernie4_5" if c.model_type == "ernie4_5" else "hunyuan-dense"
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(out), arch)
    add_text_keys(w, c, rope_freq_base=rope["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps, key_length=c.head_dim,
                  value_length=c.head_dim, file_type=gguf.LlamaFileType.ALL_F32)
    if arch == "hunyuan-dense" and rope.get("rope_type") == "dynamic":
        w.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (c.head_dim / (c.head_dim - 2)))
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1)
        w.add_rope_scaling_orig_ctx_len(256 * 1024)
        w.add_context_length(256 * 1024)
    add_keys(w, **(extra or {}))
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, arch)
    _finish(w, (), metadata)  # (the converter's second context / base key replaces the first, as here)
    return out


def _ernie(tmp: Path) -> tuple[Any, Path]:  # ERNIE-4.5-0.3B's form: head size 128 != width / heads, tied
    import transformers as tf

    cfg = tf.Ernie4_5Config(**TINY, head_dim=32, use_bias=False, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return built(tmp, "ernie", tf.Ernie4_5ForCausalLM(cfg))


def _ernie_untied(tmp: Path) -> tuple[Any, Path]:
    import transformers as tf

    cfg = tf.Ernie4_5Config(**TINY, head_dim=16, use_bias=False, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return built(tmp, "ernie_untied", tf.Ernie4_5ForCausalLM(cfg))


def _hunyuan(tmp: Path) -> tuple[Any, Path]:  # Hunyuan-0.5B..7B's form: NTK alpha 1,000, q / k norms, tied
    import transformers as tf

    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}
    cfg = tf.HunYuanDenseV1Config(**{**TINY, "max_position_embeddings": 32 * 1024}, head_dim=32,
                                  rope_parameters=rope, tie_word_embeddings=True)
    return built(tmp, "hunyuan", tf.HunYuanDenseV1ForCausalLM(cfg))


def _hunyuan_biased(tmp: Path) -> tuple[Any, Path]:  # a plain rotary, biases on q / k / v / output, untied
    import transformers as tf

    cfg = tf.HunYuanDenseV1Config(**TINY, head_dim=16, attention_bias=True, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return built(tmp, "hunyuan_biased", tf.HunYuanDenseV1ForCausalLM(cfg))


CASES = {"ernie": _ernie, "ernie_untied": _ernie_untied, "hunyuan": _hunyuan, "hunyuan_biased": _hunyuan_biased}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_ernie_or_hunyuan_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    hf, folder = CASES[name](tmp_path)
    assert read_back(hf, write_dense(hf, folder, tmp_path / f"{name}.gguf")) <= 1e-4


def test_a_hunyuan_file_with_its_alpha_as_a_key_stretches_the_base(tmp_path: Path) -> None:
    """llama.cpp stretches `rope.freq_base` by `rope.scaling.alpha` where a file has it: the checkpoint's own base
    and alpha as keys make the same model."""
    hf, folder = _hunyuan(tmp_path)
    path = write_dense(hf, folder, tmp_path / "alpha.gguf", extra={"rope_scaling_alpha": 1000.0},
                       metadata={"hunyuan-dense.rope.freq_base": 10000.0})
    assert read_back(hf, path) <= 1e-4


@pytest.mark.parametrize("make, metadata, match", [
    (_ernie, {"ernie4_5.rope.dimension_count": 16}, "rope.dimension_count"),
    (_hunyuan_biased, {"hunyuan-dense.rope.dimension_count": 8}, "rope.dimension_count")])
def test_partial_rotary_files_are_refused(tmp_path: Path, make: Any, metadata: dict[str, Any], match: str) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = make(tmp_path)
    path = write_dense(hf, folder, tmp_path / "partial.gguf",
                       extra={"rope_dimension_count": hf.config.head_dim}, metadata=metadata)
    with pytest.raises(UnsupportedModelError, match=match):
        load(resolve(str(path)))


def test_a_biased_ernie_file_is_refused(tmp_path: Path) -> None:
    import transformers as tf

    from llmc.export.sources import load, resolve

    cfg = tf.Ernie4_5Config(**TINY, head_dim=16, use_bias=True, tie_word_embeddings=True)
    hf, folder = built(tmp_path, "ernie_biased", tf.Ernie4_5ForCausalLM(cfg))
    with pytest.raises(UnsupportedModelError, match="bias"):
        load(resolve(str(write_dense(hf, folder, tmp_path / "biased.gguf"))))
