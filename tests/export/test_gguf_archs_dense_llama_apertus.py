"""Apertus GGUF files written as llama.cpp's `ApertusModel` writes them, read back by llmc
(gguf_archs/dense_llama_apertus) to the logits of the checkpoint they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
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


def write_apertus(model: Any, folder: Path, out: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """`TextModel`'s keys (llama3 scaling written by no key), `LlamaModel`'s vocabulary size and rotated dims, the
    `rope_freqs` divisors of llama3; q / k rows as they are (`undo_permute = False`); each layer's xIELU alpha_p /
    alpha_n / beta / eps out of the tensors into the `xielu.*` arrays."""
    import gguf

    c = model.config
    rope = dict(c.rope_parameters)
    head = c.head_dim
    w = gguf.GGUFWriter(str(out), "apertus")
    add_text_keys(w, c, rope_freq_base=rope["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps, key_length=head,
                  value_length=head, file_type=gguf.LlamaFileType.ALL_F32, vocab_size=c.vocab_size,
                  rope_dimension_count=head)
    _tokenizer(w, folder, c.vocab_size)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_divisors(rope, head))
    xielu: dict[str, list[float]] = {"alpha_p": [], "alpha_n": [], "beta": [], "eps": []}

    def collect(name: str, values: np.ndarray) -> np.ndarray | list[tuple[str, np.ndarray]]:
        if ".act_fn." not in name:
            return values
        xielu[name.rsplit(".", 1)[1]].append(values.item())
        return []
    add_tensors(w, model, gguf.MODEL_ARCH.APERTUS, collect)
    w.add_xielu_alpha_n(xielu["alpha_n"])
    w.add_xielu_alpha_p(xielu["alpha_p"])
    w.add_xielu_beta(xielu["beta"])
    w.add_xielu_eps(xielu["eps"])
    _finish(w, leave_out, None)
    return out


def _apertus(tmp: Path) -> tuple[Any, Path]:
    import torch
    import transformers as tf

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = tf.ApertusForCausalLM(tf.ApertusConfig(**TINY, head_dim=16, rope_parameters=rope))
    with torch.no_grad():  # (each layer's xIELU its own: alphas moved off their start, beta too)
        for i, layer in enumerate(model.model.layers):
            layer.mlp.act_fn.alpha_p.normal_(0.0, 0.5)
            layer.mlp.act_fn.alpha_n.normal_(0.0, 0.5)
            layer.mlp.act_fn.beta.fill_(0.5 + 0.25 * i)
    return built(tmp, "apertus", model)


def test_an_apertus_gguf_is_the_model_it_came_from(tmp_path: Path) -> None:
    hf, folder = _apertus(tmp_path)
    hf.set_attn_implementation("eager")
    assert read_back(hf, write_apertus(hf, folder, tmp_path / "model.gguf")) <= 1e-4


def test_an_apertus_gguf_without_its_xielu_values_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _apertus(tmp_path)
    path = write_apertus(hf, folder, tmp_path / "model.gguf", leave_out=("xielu.beta",))
    with pytest.raises(UnsupportedModelError, match="xielu.beta"):
        load(resolve(str(path)))
