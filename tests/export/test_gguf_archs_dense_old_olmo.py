"""OLMo 1 GGUF files (llama.cpp's `olmo`) as `OlmoModel` writes them, read back by llmc (gguf_archs/dense_old_olmo)
to the logits of the checkpoint they came from: OLMo-1B's form (tied) and OLMo 1.7's (untied, q / k / v clamped),
here with fewer KV heads too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import TINY, _finish, _tokenizer, add_tensors, add_text_keys, built, permute_qk, read_back


def write_olmo(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """As `OlmoModel` writes it: `TextModel`'s keys (layers, context, width, MLP width, heads, KV heads, rotary
    base), the LayerNorm epsilon 1e-5, the clamp where the checkpoint has clip_qkv; q / k rows reordered as
    `LlamaModel.permute` reorders them (k by the KV heads)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(out), "olmo")
    add_text_keys(w, c, rope_freq_base=c.rope_parameters["rope_theta"], file_type=gguf.LlamaFileType.ALL_F32,
                  layer_norm_eps=1e-5)
    if c.clip_qkv is not None:
        w.add_clamp_kqv(c.clip_qkv)
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, gguf.MODEL_ARCH.OLMO, permute_qk(c))  # (OLMo has no q / k biases)
    _finish(w, (), metadata)
    return out


FORMS = {"1b": dict(num_key_value_heads=4, tie_word_embeddings=True, clip_qkv=None),  # OLMo-1B
         "1.7": dict(num_key_value_heads=2, tie_word_embeddings=False, clip_qkv=0.5)}  # OLMo 1.7 (+ KV heads)


def _olmo(tmp: Path, form: str) -> tuple[Any, Path]:
    import transformers as tf

    config = tf.OlmoConfig(**{**TINY, **FORMS[form]}, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return built(tmp, f"olmo-{form}", tf.OlmoForCausalLM(config))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_an_olmo_gguf_is_the_model_it_came_from(tmp_path: Path, form: str) -> None:
    hf, folder = _olmo(tmp_path, form)
    assert read_back(hf, write_olmo(hf, folder, tmp_path / "olmo.gguf")) <= 1e-4


def test_an_olmo_gguf_of_another_norm_epsilon_is_refused(tmp_path: Path) -> None:
    from llmc.errors import UnsupportedModelError
    from llmc.export.sources import load, resolve

    hf, folder = _olmo(tmp_path, "1b")
    path = write_olmo(hf, folder, tmp_path / "olmo.gguf", metadata={"olmo.attention.layer_norm_epsilon": 1e-6})
    with pytest.raises(UnsupportedModelError, match="layer_norm_epsilon"):
        load(resolve(str(path)))
