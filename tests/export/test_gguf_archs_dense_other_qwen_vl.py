"""The language models of Qwen2-VL / Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE GGUF files
(llmc/export/gguf_archs/dense_other_qwen_vl.py), written as llama.cpp's converter writes them, read back to the
logits of the text model they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import TINY, _finish, _tokenizer, add_tensors, add_text_keys, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_vl_text(model: Any, folder: Path, out: Path, arch: str, sections: list[int], **extra: Any) -> Path:
    """A Qwen2 / Qwen3 text model as `Qwen2VLModel` / `Qwen3VLTextModel` write theirs: `TextModel`'s keys (the rotary
    base, the RMS epsilon, the head size), the multimodal sections (Qwen3-VL: its DeepStack layer count too); every
    tensor by gguf's name table as it is. `extra`: keys added by the writer's own call."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(out), arch)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    add_text_keys(w, c, rope_freq_base=c.rope_parameters["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps,
                  key_length=head, value_length=head, file_type=gguf.LlamaFileType.ALL_F32,
                  rope_dimension_sections=sections, **extra)
    if arch == "qwen3vl":
        w.add_num_deepstack_layers(3)
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, arch)
    _finish(w, (), None)
    return out


def write_vl_moe(model: Any, folder: Path, out: Path, sections: list[int]) -> Path:
    """A Qwen3-MoE text model as `Qwen3VLMoeTextModel` writes it: `Qwen3MoeModel`'s keys (the experts' width) and
    the sections; the experts stacked per projection."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, h)
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_rope_dimension_sections(sections)
        w.add_num_deepstack_layers(3)

    return write_moe(model, folder, out, "qwen3vlmoe", keys)


def _qwen2(tmp: Path) -> tuple[Any, Path]:  # Qwen2.5-VL-7B's text: q / k / v biases, GQA, its own head
    import transformers as tf

    cfg = tf.Qwen2Config(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         tie_word_embeddings=False)
    return built(tmp, "qwen2vl", tf.Qwen2ForCausalLM(cfg))


def _qwen3(tmp: Path) -> tuple[Any, Path]:  # Qwen3-VL's text: q / k norms, a head wider than width / heads
    import transformers as tf

    cfg = tf.Qwen3Config(**TINY, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 5e6},
                         tie_word_embeddings=True)
    return built(tmp, "qwen3vl", tf.Qwen3ForCausalLM(cfg))


def _qwen3_moe(tmp: Path) -> tuple[Any, Path]:  # Qwen3-VL-30B-A3B's text
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                            norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 5e6},
                            tie_word_embeddings=False)
    return built(tmp, "qwen3vlmoe", tf.Qwen3MoeForCausalLM(cfg))


@pytest.mark.parametrize(("make", "arch", "sections"), [(_qwen2, "qwen2vl", [2, 3, 3, 0]),
                                                        (_qwen3, "qwen3vl", [6, 5, 5, 0])])
def test_a_vl_text_gguf_is_its_text_model(tmp_path: Path, make: Any, arch: str, sections: list[int]) -> None:
    hf, folder = make(tmp_path)
    assert read_back(hf, write_vl_text(hf, folder, tmp_path / f"{arch}.gguf", arch, sections)) <= 1e-4


def test_a_vl_moe_text_gguf_is_its_text_model(tmp_path: Path) -> None:
    hf, folder = _qwen3_moe(tmp_path)
    assert read_back(hf, write_vl_moe(hf, folder, tmp_path / "moe.gguf", [2, 3, 3, 0])) <= 1e-4


@pytest.mark.parametrize("sections", [[2, 3, 2, 0], [2, 3, 2, 1]])
def test_sections_that_do_not_turn_text_as_one_rotary_are_refused(tmp_path: Path, sections: list[int]) -> None:
    hf, folder = _qwen2(tmp_path)
    path = write_vl_text(hf, folder, tmp_path / "q.gguf", "qwen2vl", sections)
    with pytest.raises(UnsupportedModelError, match="dimension_sections"):
        read_back(hf, path)


def test_a_partly_rotated_head_is_refused(tmp_path: Path) -> None:
    hf, folder = _qwen2(tmp_path)
    path = write_vl_text(hf, folder, tmp_path / "q.gguf", "qwen2vl", [1, 1, 2, 0], rope_dimension_count=8)
    with pytest.raises(UnsupportedModelError, match="dimension_count"):
        read_back(hf, path)
