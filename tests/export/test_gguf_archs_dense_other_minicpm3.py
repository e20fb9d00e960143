"""MiniCPM3 GGUF files (llmc/export/gguf_archs/dense_other_minicpm3.py) written as llama.cpp's `MiniCPM3Model`
writes them, read back to the logits of the checkpoint they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, add_keys, add_tensors, built, read_back

from llmc.errors import UnsupportedModelError


def write_minicpm3(model: Any, folder: Path, out: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """As `MiniCPM3Model` writes it: its own keys only (context, width, layers, MLP width, heads, KV heads, RMS
    epsilon, vocabulary size, the latent ranks, the q / k head size and the rotated dims; no rotary base, no
    multipliers); longrope's factors as `rope_factors_long` / `rope_factors_short`; the tensors as they are, no
    lm_head where tied. `leave_out` drops keys."""
    import gguf

    c = model.config
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(out), "minicpm3")
    add_keys(w, file_type=gguf.LlamaFileType.ALL_F32, context_length=c.max_position_embeddings,
             embedding_length=c.hidden_size, block_count=c.num_hidden_layers, feed_forward_length=c.intermediate_size,
             head_count=c.num_attention_heads, head_count_kv=c.num_key_value_heads, layer_norm_rms_eps=c.rms_norm_eps,
             vocab_size=c.vocab_size, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
             key_length=c.qk_nope_head_dim + c.qk_rope_head_dim, rope_dimension_count=c.qk_rope_head_dim)
    _tokenizer(w, folder, c.vocab_size)
    if rope.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    add_tensors(w, model, gguf.MODEL_ARCH.MINICPM3)
    _finish(w, leave_out, None)
    return out


LATENT = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=None,
              scale_emb=12, scale_depth=1.4, dim_model_base=256)


def _minicpm3_4b(tmp: Path) -> tuple[Any, Path]:  # MiniCPM3-4B's form: longrope (short factors up to its context)
    import transformers as tf

    half = 4  # (rotated dims / 2)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.3 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)], "original_max_position_embeddings": 256}
    cfg = tf.MiniCPM3Config(**{**TINY, "num_key_value_heads": 4}, **LATENT, rope_parameters=rope,
                            tie_word_embeddings=False)
    return built(tmp, "minicpm3_4b", tf.MiniCPM3ForCausalLM(cfg))


def _minicpm3_tied(tmp: Path) -> tuple[Any, Path]:  # a plain rotary, the head tied
    import transformers as tf

    cfg = tf.MiniCPM3Config(**{**TINY, "num_key_value_heads": 4}, **LATENT, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return built(tmp, "minicpm3_tied", tf.MiniCPM3ForCausalLM(cfg))


CASES = {"minicpm3_4b": _minicpm3_4b, "minicpm3_tied": _minicpm3_tied}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_minicpm3_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    hf, folder = CASES[name](tmp_path)
    assert read_back(hf, write_minicpm3(hf, folder, tmp_path / f"{name}.gguf")) <= 1e-4


def test_a_minicpm3_file_without_the_query_latent_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _minicpm3_tied(tmp_path)
    path = write_minicpm3(hf, folder, tmp_path / "no_q_lora.gguf", leave_out=("minicpm3.attention.q_lora_rank",))
    with pytest.raises(UnsupportedModelError, match="q_lora_rank"):
        load(resolve(str(path)))
