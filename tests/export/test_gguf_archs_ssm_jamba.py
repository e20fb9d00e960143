"""GGUF files of Jamba written as llama.cpp's converter writes them (`JambaModel`), from the checkpoint the tiny model
saved, read back to its logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import _finish, _tokenizer, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_ssm_mamba2 import _checkpoint


def write_jamba(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """As `JambaModel` writes it: the context, width, MLP width, heads, per-layer KV heads (0 off the attention
    layers, from the attention period and offset), the Mamba mixer's sizes (inner as expand x the width, dt's rank),
    the RMS epsilon, the expert counts; no layer pattern beyond that. Tensors by gguf's table: each mixture layer's
    experts stacked per projection, A as -exp(A_log), the convolution squeezed; the tokens as they are."""
    import gguf
    import torch

    c = model.config
    n = c.num_hidden_layers
    w = gguf.GGUFWriter(str(out), "jamba")
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([0] * c.attn_layer_offset + [c.num_key_value_heads if (i - c.attn_layer_offset)
                                                     % c.attn_layer_period == 0 else 0
                                                     for i in range(c.attn_layer_offset, n)])
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_inner_size(c.mamba_expand * c.hidden_size)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_time_step_rank(c.mamba_dt_rank)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.JAMBA, n)
    stacks: dict[int | None, dict[str, Any]] = {}
    for name, data in _checkpoint(folder).items():
        name = name.replace(".moe.", ".feed_forward.")
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if bid is not None and not (bid >= c.expert_layer_offset
                                    and (bid - c.expert_layer_offset) % c.expert_layer_period == 0):
            name = name.replace(".experts.0.", ".")
        if ".feed_forward.experts." in name:
            stacks.setdefault(bid, {})[name] = data
            if len(stacks[bid]) == 3 * c.num_experts:
                for kind in ("down_proj", "gate_proj", "up_proj"):
                    stacked = torch.stack([stacks[bid][f"model.layers.{bid}.feed_forward.experts.{x}.{kind}.weight"]
                                           for x in range(c.num_experts)])
                    merged = f"model.layers.{bid}.mlp.experts.{kind}.weight"
                    w.add_tensor(str(names.get_name(merged, try_suffixes=(".weight",))),
                                 np.ascontiguousarray(stacked.numpy()))
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        if mapped.endswith("ssm_conv1d.weight"):
            data = data.squeeze()
        if name.endswith(".A_log"):
            data = -torch.exp(data)
        w.add_tensor(mapped, np.ascontiguousarray(data.numpy()))
    _finish(w, (), metadata)
    return out


def _jamba(tmp: Path, layers: int = 4, attn: tuple[int, int] = (2, 1), moe: tuple[int, int] = (2, 1),
           tied: bool = False) -> tuple[Any, Path]:
    import transformers as tf

    config = tf.JambaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=attn[0],
        attn_layer_offset=attn[1], expert_layer_period=moe[0], expert_layer_offset=moe[1], mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return built(tmp, f"jamba_{layers}_{attn}_{moe}_{tied}", tf.JambaForCausalLM(config))


CASES = {
    # (Jamba's own: attention every 8 layers from 4, experts every 2 from 1)
    "jamba_v0_1_pattern": (lambda tmp: _jamba(tmp, layers=9, attn=(8, 4), moe=(2, 1)), write_jamba),
    "jamba_one_attention_tied": (lambda tmp: _jamba(tmp, layers=3, attn=(4, 1), moe=(3, 0), tied=True), write_jamba),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_jamba_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    make, write = CASES[name]
    hf, folder = make(tmp_path)
    assert read_back(hf, write(hf, folder, tmp_path / f"{name}.gguf")) <= 1e-4


def test_a_jamba_layer_pattern_is_read_back(tmp_path: Path) -> None:
    from llmc.export.gguf_read import config_for

    hf, folder = _jamba(tmp_path, layers=9, attn=(8, 4), moe=(2, 1))
    config = config_for(write_jamba(hf, folder, tmp_path / "pattern.gguf"))
    assert config is not None
    assert config.layers_block_type == hf.config.layers_block_type
    assert config.layers_num_experts == hf.config.layers_num_experts


def test_a_jamba_attention_no_period_gives_is_refused(tmp_path: Path) -> None:
    hf, folder = _jamba(tmp_path)
    path = write_jamba(hf, folder, tmp_path / "irregular.gguf",
                       metadata={"jamba.attention.head_count_kv": [2, 2, 0, 0]})
    with pytest.raises(UnsupportedModelError, match=r"attention layers \[0, 1\] of 4"):
        read_back(hf, path)
