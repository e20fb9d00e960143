"""Phi-2 GGUF files (llama.cpp's `phi2`) as `Phi2Model` writes them, read back by llmc (gguf_archs/dense_old_phi2)
to the logits of the checkpoint they came from: q / k / v apart (today's checkpoints) and fused (files converted from
Microsoft's first format)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, add_keys, add_tensors, built, read_back


def write_phi2(model: Any, folder: Path, out: Path, fused: bool = False,
               metadata: dict[str, Any] | None = None) -> Path:
    """As `Phi2Model` writes it: context, width, 4 x the width as the MLP's, layers, heads, KV heads (the heads),
    LayerNorm epsilon, rotated dims (int(share x width) // heads), no BOS added; every tensor by gguf's name table;
    `fused`: q / k / v as one `attn_qkv` (weight and bias), as files of the first Phi-2 format hold them."""
    import gguf

    c = model.config
    share = c.rope_parameters["partial_rotary_factor"]
    w = gguf.GGUFWriter(str(out), "phi2")
    add_keys(w, context_length=c.max_position_embeddings, embedding_length=c.hidden_size,
             feed_forward_length=4 * c.hidden_size, block_count=c.num_hidden_layers, head_count=c.num_attention_heads,
             head_count_kv=c.num_attention_heads, layer_norm_eps=c.layer_norm_eps,
             rope_dimension_count=int(share * c.hidden_size) // c.num_attention_heads,
             file_type=gguf.LlamaFileType.ALL_F32, add_bos_token=False)
    _tokenizer(w, folder, c.vocab_size)
    state = model.state_dict()

    def fuse(name: str, values: np.ndarray) -> np.ndarray | list[tuple[str, np.ndarray]]:
        if not (fused and ".self_attn." in name and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")):
            return values
        if ".q_proj." not in name:
            return []
        qkv = [state[name.replace("q_proj", p)].float().numpy() for p in ("q_proj", "k_proj", "v_proj")]
        return [(f"blk.{name.split('.')[2]}.attn_qkv.{name.split('.')[-1]}", np.concatenate(qkv))]
    add_tensors(w, model, gguf.MODEL_ARCH.PHI2, fuse)
    _finish(w, (), metadata)
    return out


def _phi2(tmp: Path) -> tuple[Any, Path]:
    """Phi-2's form: MHA, heads of 80 with 32 dims rotated (0.4), 4 x the width as the MLP's, biases everywhere,
    an untied head with a bias."""
    import transformers as tf

    config = tf.PhiConfig(**{**TINY, "hidden_size": 320, "intermediate_size": 1280, "num_key_value_heads": 4},
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4})
    return built(tmp, "phi2", tf.PhiForCausalLM(config))


@pytest.mark.parametrize("fused", [False, True])
def test_a_phi2_gguf_is_the_model_it_came_from(tmp_path: Path, fused: bool) -> None:
    hf, folder = _phi2(tmp_path)
    assert hf.model.rotary_emb.inv_freq.numel() == 16
    assert read_back(hf, write_phi2(hf, folder, tmp_path / "phi2.gguf", fused=fused)) <= 1e-4


def test_a_phi2_gguf_rotating_what_transformers_cannot_is_refused(tmp_path: Path) -> None:
    from llmc.errors import UnsupportedModelError
    from llmc.export.sources import load, resolve

    hf, folder = _phi2(tmp_path)
    path = write_phi2(hf, folder, tmp_path / "phi2.gguf", metadata={"phi2.rope.dimension_count": 81})
    with pytest.raises(UnsupportedModelError, match="rope.dimension_count 81"):
        load(resolve(str(path)))
