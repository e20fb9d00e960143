"""Granite SWA GGUF files as Granite's converter (`GraniteModel`) writes them with the keys and tensors llama.cpp's
`granite_swa` loader requires (the converter's own class was not among the sources read: the module's docstring), read back by llmc (gguf_archs/dense_llama_granite_swa) to the logits of the checkpoint
they came from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, add_tensors, add_text_keys, built, permute_qk, read_back

from llmc.errors import UnsupportedModelError

ARCH = "granite_swa"


def write_granite_swa(model: Any, folder: Path, out: Path, rope_pattern: bool = True,
                      keys: dict[str, Any] | None = None, arrays: dict[str, list[Any]] | None = None,
                      metadata: dict[str, Any] | None = None, leave_out: tuple[str, ...] = (),
                      extra: dict[str, np.ndarray] | None = None) -> Path:
    """`TextModel`'s keys without the head size (popped by `GraniteModel`), `LlamaModel`'s vocabulary size and
    rotated dims (width / heads), the multipliers that are not 0 as `attention.scale`, `embedding_scale`,
    `residual_scale`, `logit_scale`; the window, the sliding layers as booleans, the rotated layers (the checkpoint's
    `layer_rope_theta` not 0) as `attention.rope_pattern` booleans (`rope_pattern` False: no such key); q / k rows
    (and biases) permuted, the sinks as `attn_sinks.weight`, the rest by Granite's name table, the head left out
    where tied. `keys` / `arrays` add keys (by the writer's calls / as `granite_swa.{name}` arrays), `metadata`
    replaces keys' values, `leave_out` drops keys, `extra` adds tensors: the files llmc must refuse."""
    import gguf

    c = model.config
    multipliers = {"attention_scale": c.attention_multiplier, "embedding_scale": c.embedding_multiplier,
                   "residual_scale": c.residual_multiplier, "logit_scale": c.logits_scaling}
    w = gguf.GGUFWriter(str(out), ARCH)
    add_text_keys(w, c, rope_freq_base=c.rope_parameters["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps,
                  file_type=gguf.LlamaFileType.ALL_F32, vocab_size=c.vocab_size,
                  rope_dimension_count=c.hidden_size // c.num_attention_heads,
                  **{key: value for key, value in multipliers.items() if value},
                  sliding_window=c.sliding_window,
                  sliding_window_pattern=[t == "sliding_attention" for t in c.layer_types], **(keys or {}))
    if rope_pattern:
        w.add_array(f"{ARCH}.attention.rope_pattern", [bool(theta) for theta in c.layer_rope_theta])
    for name, values in (arrays or {}).items():
        w.add_array(f"{ARCH}.{name}", values)
    _tokenizer(w, folder, c.vocab_size)
    permute = permute_qk(c)

    def transform(name: str, values: np.ndarray) -> np.ndarray | list[tuple[str, np.ndarray]]:
        if name.endswith("self_attn.sinks"):
            return [(f"blk.{name.split('.')[2]}.attn_sinks.weight", values)]
        return permute(name, values)

    add_tensors(w, model, "granite", transform)
    _finish(w, leave_out, metadata, extra)
    return out


def _granite_swa(tmp: Path, rope: str = "nope", **extra: Any) -> tuple[Any, Path]:
    """Granite SWA's form at a tiny size: a full layer among sliding ones 8 wide (narrower than the 100 positions
    read), the full layer without positions (`rope` "nope"; "all": every layer rotated), Granite's multipliers,
    sinks of either sign large enough to move the softmax."""
    import torch
    import transformers as tf

    theta = 5e4
    config = {**dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5,
                     tie_word_embeddings=True, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                     layer_rope_theta=[theta, 0.0 if rope == "nope" else theta, theta, theta],
                     rope_parameters={"rope_type": "default", "rope_theta": theta}),
              **{**TINY, "num_hidden_layers": 4}, **extra}
    model = tf.GraniteSWAForCausalLM(tf.GraniteSWAConfig(**config))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(2.0 * torch.randn_like(layer.self_attn.sinks))
    return built(tmp, f"granite_swa_{rope}", model)


CASES = {"tied, full layer without positions": (lambda tmp: _granite_swa(tmp), {}),
         "untied, biases": (lambda tmp: _granite_swa(tmp, tie_word_embeddings=False, attention_bias=True,
                                                     mlp_bias=True), {}),
         "every layer rotated, no rope_pattern (llama.cpp rotates all)": (
             lambda tmp: _granite_swa(tmp, rope="all"), {"rope_pattern": False}),
         "no attention.scale (llama.cpp: 1 / sqrt(head size))": (
             lambda tmp: _granite_swa(tmp, attention_multiplier=1 / math.sqrt(16)),
             {"leave_out": (f"{ARCH}.attention.scale",)}),
         "no embedding / residual scales (llama.cpp: none)": (
             lambda tmp: _granite_swa(tmp, embedding_multiplier=1.0, residual_multiplier=1.0),
             {"leave_out": (f"{ARCH}.embedding_scale", f"{ARCH}.residual_scale")})}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_granite_swa_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    make, options = CASES[name]
    hf, folder = make(tmp_path)
    assert read_back(hf, write_granite_swa(hf, folder, tmp_path / "model.gguf", **options)) <= 1e-4


def test_the_window_and_the_sinks_move_the_logits(tmp_path: Path) -> None:
    """The round trip would not show a reader that dropped the window or the sinks if neither moved the logits."""
    import torch

    hf, _ = _granite_swa(tmp_path)
    ids = torch.tensor([np.random.default_rng(1).integers(3, 320, 100).tolist()])
    with torch.no_grad():
        base = hf(ids).logits
        hf.config.layer_types = ["full_attention"] * 4
        windowless = hf(ids).logits
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        sinkless = hf(ids).logits
    assert float((base - windowless).abs().max()) > 1e-2
    assert float((windowless - sinkless).abs().max()) > 1e-2


@pytest.mark.parametrize("options, match", [
    ({"keys": {"expert_count": 4, "expert_used_count": 2}}, "expert_count"),
    ({"arrays": {"deepstack_mapping": [-1, 1, -1, -1]}}, "deepstack_mapping"),
    ({"keys": {"key_length": 32, "value_length": 32}}, "attention.key_length"),
    ({"metadata": {f"{ARCH}.rope.dimension_count": 8}}, "rope.dimension_count"),
    ({"keys": {"head_count_kv": [2, 4, 2, 2]}}, "differs between layers"),
    ({"extra": {"rope_freqs.weight": np.ones(8, dtype=np.float32)}}, "rope_freqs")])
def test_a_granite_swa_file_llmc_cannot_read_faithfully_is_refused(tmp_path: Path, options: dict[str, Any],
                                                                   match: str) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _granite_swa(tmp_path)
    path = write_granite_swa(hf, folder, tmp_path / "model.gguf", **options)
    with pytest.raises(UnsupportedModelError, match=match):
        load(resolve(str(path)))


def test_a_granite_swa_file_without_its_layer_pattern_is_refused_naming_the_key(tmp_path: Path) -> None:
    from llmc.errors import InputError
    from llmc.export.sources import load, resolve

    hf, folder = _granite_swa(tmp_path)
    path = write_granite_swa(hf, folder, tmp_path / "model.gguf",
                             leave_out=(f"{ARCH}.attention.sliding_window_pattern",))
    with pytest.raises(InputError, match="sliding_window_pattern"):
        load(resolve(str(path)))
