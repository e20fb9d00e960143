"""Command-R (`command-r`) and Command R7B (`cohere2`) GGUF files written as llama.cpp's `CommandR2Model` /
`Cohere2Model` write them, read back by llmc (gguf_archs/dense_llama_cohere) to the logits of the checkpoint they
came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, add_tensors, add_text_keys, built, read_back

from llmc.errors import UnsupportedModelError


def write_cohere(model: Any, folder: Path, out: Path, extra: dict[str, np.ndarray] | None = None) -> Path:
    """`TextModel`'s keys (context, width, layers, MLP width, heads, KV heads, the rotary base, the LayerNorm
    epsilon; the head size where the config has one), the logit scale, rotary scaling type none; Cohere2 adds its
    window, the vocabulary size and the rotated dims, and drops the (all-zero) biases. No tensor reordered; no head
    (tied)."""
    import gguf

    c = model.config
    arch = {"cohere": "command-r", "cohere2": "cohere2"}[c.model_type]
    w = gguf.GGUFWriter(str(out), arch)
    add_text_keys(w, c, rope_freq_base=c.rope_parameters["rope_theta"], layer_norm_eps=c.layer_norm_eps)
    if c.to_dict().get("head_dim") is not None:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_logit_scale(c.logit_scale)
    if arch == "cohere2":
        w.add_sliding_window(c.sliding_window)
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, arch,  # (no head: tied; Cohere2's biases dropped)
                skip=lambda name: name == "lm_head.weight" or (arch == "cohere2" and name.endswith(".bias")))
    _finish(w, (), None, extra)
    return out


def _cohere(tmp: Path, qk_norm: bool) -> tuple[Any, Path]:
    import torch
    import transformers as tf

    model = tf.CohereForCausalLM(tf.CohereConfig(**TINY, logit_scale=0.3, use_qk_norm=qk_norm))
    with torch.no_grad():  # (per-head norms moved off their start per element: built() only scales a 2-D one)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    return built(tmp, "cohere", model)


def _cohere2(tmp: Path) -> tuple[Any, Path]:
    import transformers as tf

    return built(tmp, "cohere2", tf.Cohere2ForCausalLM(tf.Cohere2Config(
        **{**TINY, "num_hidden_layers": 5}, sliding_window=8, logit_scale=0.25, rope_parameters={
            "rope_type": "default", "rope_theta": 50000.0})))


CASES = {"command-r": (lambda tmp: _cohere(tmp, False), write_cohere),
         "command-r-plus (q / k norms)": (lambda tmp: _cohere(tmp, True), write_cohere),
         "cohere2": (_cohere2, write_cohere)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_cohere_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    make, write = CASES[name]
    hf, folder = make(tmp_path)
    hf.set_attn_implementation("eager")
    assert read_back(hf, write(hf, folder, tmp_path / "model.gguf")) <= 1e-4


def test_cohere2_layers_follow_llama_cpp_pattern(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _cohere2(tmp_path)
    ours = load(resolve(str(write_cohere(hf, folder, tmp_path / "model.gguf")))).model
    assert ours.config.layer_types == ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"]
    assert ours.config.sliding_window == 8 and ours.config.logit_scale == 0.25


def test_a_cohere_file_with_a_head_of_its_own_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _cohere(tmp_path, False)
    head = np.zeros((TINY["vocab_size"], TINY["hidden_size"]), dtype=np.float32)
    path = write_cohere(hf, folder, tmp_path / "model.gguf", extra={"output.weight": head})
    with pytest.raises(UnsupportedModelError, match="output.weight"):
        load(resolve(str(path)))
