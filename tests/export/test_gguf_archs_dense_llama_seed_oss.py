"""Seed-OSS GGUF files written as llama.cpp's `SeedOssModel` writes them, read back by llmc
(gguf_archs/dense_llama_seed_oss) to the logits of the checkpoint they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, built, read_back


def write_seed_oss(model: Any, folder: Path, out: Path) -> Path:
    """`TextModel`'s keys only (the head size as `key_length`); no tensor reordered; the head left out where tied."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(out), "seed_oss")
    for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_key_length, c.head_dim),
                       (w.add_value_length, c.head_dim), (w.add_file_type, gguf.LlamaFileType.ALL_F32)):
        add(value)
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.SEED_OSS, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        w.add_tensor(mapped, np.ascontiguousarray(tensor.detach().float().numpy()))
    _finish(w, (), None)
    return out


def _seed_oss(tmp: Path, **extra: Any) -> tuple[Any, Path]:
    import transformers as tf

    return built(tmp, "seed_oss", tf.SeedOssForCausalLM(tf.SeedOssConfig(**TINY, head_dim=32, **extra)))


CASES = {"seed-oss (q / k / v biases)": dict(attention_bias=True, attention_out_bias=False),
         "seed-oss (o bias too, tied)": dict(attention_bias=True, attention_out_bias=True, tie_word_embeddings=True)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_seed_oss_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    hf, folder = _seed_oss(tmp_path, **CASES[name])
    hf.set_attn_implementation("eager")
    assert read_back(hf, write_seed_oss(hf, folder, tmp_path / "model.gguf")) <= 1e-4
