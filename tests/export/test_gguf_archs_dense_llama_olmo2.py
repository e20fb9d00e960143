"""OLMo 2 GGUF files written as llama.cpp's `Olmo2Model` writes them, read back by llmc
(gguf_archs/dense_llama_olmo2) to the logits of the checkpoint they came from; its OLMo 3 form refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, built, read_back

from llmc.errors import UnsupportedModelError


def write_olmo2(model: Any, folder: Path, out: Path, window: int | None = None) -> Path:
    """`TextModel`'s keys (the rotary base, the RMS epsilon, the head size where the config has one); no tensor
    reordered. `window`: the keys `Olmo2Model` adds for an OLMo 3 checkpoint (its window and layer pattern)."""
    import gguf

    c = model.config
    n = c.num_hidden_layers
    w = gguf.GGUFWriter(str(out), "olmo2")
    for add, value in ((w.add_block_count, n), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_file_type, gguf.LlamaFileType.ALL_F32)):
        add(value)
    if c.to_dict().get("head_dim") is not None:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if window:
        w.add_sliding_window(window)
        w.add_sliding_window_pattern([(i + 1) % 4 != 0 for i in range(n)])
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.OLMO2, n)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        w.add_tensor(mapped, np.ascontiguousarray(tensor.detach().float().numpy()))
    _finish(w, (), None)
    return out


def _olmo2(tmp: Path) -> tuple[Any, Path]:
    import transformers as tf

    return built(tmp, "olmo2", tf.Olmo2ForCausalLM(tf.Olmo2Config(**TINY, rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0})))


def test_an_olmo2_gguf_is_the_model_it_came_from(tmp_path: Path) -> None:
    hf, folder = _olmo2(tmp_path)
    hf.set_attn_implementation("eager")
    assert read_back(hf, write_olmo2(hf, folder, tmp_path / "model.gguf")) <= 1e-4


def test_an_olmo3_gguf_written_as_olmo2_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _olmo2(tmp_path)
    with pytest.raises(UnsupportedModelError, match="sliding_window 8"):
        load(resolve(str(write_olmo2(hf, folder, tmp_path / "model.gguf", window=8))))
