"""GLM-4-0414 / GLM-Z1 GGUF files (llmc/export/gguf_archs/dense_other_glm4.py) written as llama.cpp's `Glm4Model`
writes them, and GLM-4-9B / ChatGLM files as its `ChatGLMModel` writes them, read back to the logits of the
checkpoint they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, add_keys, add_tensors, add_text_keys, built, read_back

from llmc.errors import UnsupportedModelError


def _normal_to_neox(rows: np.ndarray, head: int, rotated: int) -> np.ndarray:
    """The converter's reordering of GLM-4.1V's q / k rows for llama.cpp's multimodal rotary: each head's rotated
    dims even ones first, then odd ones."""
    heads = rows.reshape(rows.shape[0] // head, head, -1)
    rot = heads[:, :rotated]
    return np.concatenate((rot[:, ::2], rot[:, 1::2], heads[:, rotated:]), axis=1).reshape(rows.shape)


def write_glm4(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
               extra: dict[str, Any] | None = None) -> Path:
    """As `Glm4Model` writes it: `TextModel`'s keys (the head size as key / value lengths), the rotated dims as
    head size x the rotary fraction; every tensor by gguf's name table as it is (the fused `gate_up_proj` as
    `ffn_up`), no lm_head where tied. `extra`: keys added (GLM-4.1V's sections, GLM-OCR's) with the writer's own
    call; with GLM-4.1V's sections its q / k rows reordered as its converter does (`_normal_to_neox`)."""
    import gguf

    c = model.config
    rope = c.rope_parameters
    rotated = int(c.head_dim * rope.get("partial_rotary_factor", 0.5))
    w = gguf.GGUFWriter(str(out), "glm4")
    add_text_keys(w, c, rope_freq_base=rope["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps, key_length=c.head_dim,
                  value_length=c.head_dim, file_type=gguf.LlamaFileType.ALL_F32, rope_dimension_count=rotated)
    add_keys(w, **(extra or {}))
    _tokenizer(w, folder, c.vocab_size)
    mrope = "rope_dimension_sections" in (extra or {})

    def transform(name: str, values: np.ndarray) -> np.ndarray:
        if mrope and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            return _normal_to_neox(values, c.head_dim, rotated)
        return values

    add_tensors(w, model, gguf.MODEL_ARCH.GLM4, transform)
    _finish(w, (), metadata)
    return out


def _glm4_9b(tmp: Path) -> tuple[Any, Path]:  # GLM-4-9B-0414's form: q / k / v biases, half of each head rotated
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    cfg = tf.Glm4Config(**TINY, head_dim=32, attention_bias=True, rope_parameters=rope, tie_word_embeddings=False)
    return built(tmp, "glm4_9b", tf.Glm4ForCausalLM(cfg))


def _glm4_32b(tmp: Path) -> tuple[Any, Path]:  # GLM-4-32B / Z1-32B's: no biases; tied here to cover the tied head
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    cfg = tf.Glm4Config(**TINY, head_dim=16, attention_bias=False, rope_parameters=rope, tie_word_embeddings=True)
    return built(tmp, "glm4_32b", tf.Glm4ForCausalLM(cfg))


def _glm4_full(tmp: Path) -> tuple[Any, Path]:  # the whole head rotated: the file's fraction, not GLM-4's 0.5
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 1.0}
    cfg = tf.Glm4Config(**TINY, head_dim=16, rope_parameters=rope, tie_word_embeddings=False)
    return built(tmp, "glm4_full", tf.Glm4ForCausalLM(cfg))


CASES = {"glm4_9b": _glm4_9b, "glm4_32b": _glm4_32b, "glm4_full": _glm4_full}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_glm4_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    hf, folder = CASES[name](tmp_path)
    assert read_back(hf, write_glm4(hf, folder, tmp_path / f"{name}.gguf")) <= 1e-4


def test_a_glm4v_text_gguf_is_its_text_model(tmp_path: Path) -> None:
    """GLM-4.1V's text half: GLM-4 with the multimodal rotary's sections and its q / k rows reordered for them."""
    hf, folder = _glm4_9b(tmp_path)
    path = write_glm4(hf, folder, tmp_path / "glm4v.gguf", extra={"rope_dimension_sections": [2, 3, 3, 0]})
    assert read_back(hf, path) <= 1e-4


@pytest.mark.parametrize("extra", [{"rope_dimension_sections": [8, 12, 12, 0]}, {"nextn_predict_layers": 1}])
def test_glm4v_sections_past_the_rotary_and_nextn_files_are_refused(tmp_path: Path, extra: dict[str, Any]) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _glm4_32b(tmp_path)
    path = write_glm4(hf, folder, tmp_path / "refused.gguf", extra=extra)
    with pytest.raises(UnsupportedModelError, match=next(iter(extra)).split("_")[-1]):
        load(resolve(str(path)))


def write_chatglm(model: Any, folder: Path, out: Path, fused: bool = False, rope_ratio: float | None = None) -> Path:
    """As `ChatGLMModel` writes `GlmForCausalLM`: its own keys (the context, width, MLP width, layers, heads, KV
    heads, RMS epsilon, the rotated dims as head size x the rotary fraction, the base 10,000 x `rope_ratio` or
    10,000: the checkpoint's rope_theta unread); every tensor by gguf's name table as it is. `fused`: q / k / v as
    THUDM's own format holds them, one `attn_qkv` product and bias (queries', keys', values' rows)."""
    import gguf

    c = model.config
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(out), "chatglm")
    add_keys(w, context_length=c.max_position_embeddings, embedding_length=c.hidden_size,
             feed_forward_length=c.intermediate_size, block_count=c.num_hidden_layers,
             head_count=c.num_attention_heads, head_count_kv=c.num_key_value_heads,
             layer_norm_rms_eps=c.rms_norm_eps, file_type=gguf.LlamaFileType.ALL_F32,
             rope_dimension_count=int(c.head_dim * rope.get("partial_rotary_factor", 0.5)), add_bos_token=False,
             rope_freq_base=10000.0 * (rope_ratio or 1.0))
    _tokenizer(w, folder, c.vocab_size)
    state = model.state_dict()

    def transform(name: str, values: np.ndarray) -> np.ndarray | list[tuple[str, np.ndarray]]:
        if not fused or ".self_attn." not in name or "o_proj" in name:
            return values
        if "q_proj" not in name:
            return []  # (written with the queries)
        i, kind = name.split(".")[2], name.rsplit(".", 1)[-1]
        parts = [state[name.replace("q_proj", p)].float().numpy() for p in ("q_proj", "k_proj", "v_proj")]
        return [(f"blk.{i}.attn_qkv.{kind}", np.concatenate(parts))]

    add_tensors(w, model, gguf.MODEL_ARCH.CHATGLM, transform)
    _finish(w, (), None)
    return out


def _glm_9b(tmp: Path, theta: float = 10000.0) -> tuple[Any, Path]:
    """GLM-4-9B-chat-hf's form: q / k / v biases, two KV heads, half of each head rotated, the fused gate / up."""
    import transformers as tf

    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5}
    cfg = tf.GlmConfig(**TINY, head_dim=16, attention_bias=True, rope_parameters=rope, tie_word_embeddings=False)
    return built(tmp, f"glm_9b_{theta}", tf.GlmForCausalLM(cfg))


@pytest.mark.parametrize("fused", [False, True])
def test_a_chatglm_gguf_is_the_model_it_came_from(tmp_path: Path, fused: bool) -> None:
    hf, folder = _glm_9b(tmp_path)
    assert read_back(hf, write_chatglm(hf, folder, tmp_path / "glm.gguf", fused=fused)) <= 1e-4


def test_a_chatglm_gguf_rotates_at_the_files_base(tmp_path: Path) -> None:
    """The converter writes 10,000 x rope_ratio, not the checkpoint's rope_theta: the file's base is the model."""
    hf, folder = _glm_9b(tmp_path, theta=500000.0)
    assert read_back(hf, write_chatglm(hf, folder, tmp_path / "glm.gguf", rope_ratio=50.0)) <= 1e-4
    assert read_back(hf, write_chatglm(hf, folder, tmp_path / "glm1.gguf")) > 1e-3
