"""GGUF files of Mamba-2, Granite 4.0-H and Falcon-H1 written as llama.cpp's converter writes them (`Mamba2Model`,
`GraniteHybridModel`, `FalconH1Model`), from the checkpoint the tiny model saved, read back to its logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _permute, _tokenizer, add_keys, add_text_keys, built, read_back

from llmc.errors import UnsupportedModelError


def _checkpoint(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}


def _padded(vocab: int, multiple: int) -> int:
    return -(vocab // -multiple) * multiple


def _mamba2_tensor(name: str, data: Any, n_group: int, d_inner: int) -> Any:
    """Mamba2Model.modify_tensors' layouts: conv1d squeezed, A and D as [heads, 1], the norm as [groups, inner /
    groups], A as -exp(A_log)."""
    import torch

    if name.endswith("conv1d.weight"):
        data = data.squeeze()
    elif name.endswith((".A_log", ".D")):
        data = data.reshape((*data.shape, 1))
    elif name.endswith("mixer.norm.weight") or name.endswith("mamba.norm.weight"):
        data = data.reshape((n_group, d_inner // n_group))
    if name.endswith(".A_log"):
        data = -torch.exp(data)
    return data


def _mamba2_name(names: Any, name: str) -> str:
    if name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise ValueError(f"gguf has no name for {name}")
    return mapped


def write_mamba2(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """As `Mamba2Model` writes it: context 2**20, no MLP width or heads (0), the mixer's keys, the token list padded to
    a multiple of 16; the mixer's tensors in its layouts."""
    import gguf

    c = model.config
    d_inner = int(c.expand * c.hidden_size)
    w = gguf.GGUFWriter(str(out), "mamba2")
    add_keys(w, context_length=2**20, embedding_length=c.hidden_size, feed_forward_length=0, head_count=0,
             block_count=c.num_hidden_layers, ssm_conv_kernel=c.conv_kernel, ssm_inner_size=d_inner,
             ssm_state_size=c.state_size, ssm_time_step_rank=d_inner // c.head_dim, ssm_group_count=c.n_groups,
             layer_norm_rms_eps=c.layer_norm_epsilon)
    _tokenizer(w, folder, _padded(c.vocab_size, 16))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MAMBA2, c.num_hidden_layers)
    for name, data in _checkpoint(folder).items():
        data = _mamba2_tensor(name, data, c.n_groups, d_inner)
        w.add_tensor(_mamba2_name(names, name), np.ascontiguousarray(data.numpy()))
    _finish(w, (), metadata)
    return out


def _mamba2(tmp: Path, tied: bool = False, vocab: int = 320) -> tuple[Any, Path]:
    import transformers as tf

    config = tf.Mamba2Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                             n_groups=2, state_size=16, chunk_size=32, tie_word_embeddings=tied,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return built(tmp, f"mamba2_{tied}_{vocab}", tf.Mamba2ForCausalLM(config))


def write_granite_hybrid(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """As `GraniteHybridModel` writes it: TextModel's and LlamaModel's keys (no head size: Granite pops it; the rotated
    dims), Granite's multipliers where set, the shared MLP's width, the mixer's keys, per-layer KV heads (0 on a Mamba
    layer), `rope.scaling.finetuned` (rotary or not), context 2**20 without it, the tokens padded to a multiple of 8;
    q / k permuted on the attention layers, the experts' and shared MLP's input_linear split in gate and up, the
    dense hybrid's shared MLP as the plain ffn, the mixer's tensors in Mamba-2's layouts."""
    import gguf
    import torch

    c = model.config
    n = c.num_hidden_layers
    attn = [i for i, t in enumerate(c.layer_types) if t in ("attention", "full_attention")]  # (the checkpoints'
    # "attention", which transformers 5 renames)
    use_rope = c.position_embedding_type == "rope"
    experts = int(c.num_local_experts or 0)
    d_inner = c.mamba_expand * c.hidden_size
    w = gguf.GGUFWriter(str(out), "granitehybrid")
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings if use_rope else 2**20)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if i in attn else 0 for i in range(n)])
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    for add, value in ((w.add_attention_scale, c.attention_multiplier), (w.add_embedding_scale, c.embedding_multiplier),
                       (w.add_residual_scale, c.residual_multiplier), (w.add_logit_scale, c.logits_scaling),
                       (w.add_expert_shared_feed_forward_length, c.shared_intermediate_size)):
        if value:
            add(value)
    add_keys(w, ssm_conv_kernel=c.mamba_d_conv, ssm_state_size=c.mamba_d_state, ssm_group_count=c.mamba_n_groups,
             ssm_inner_size=d_inner, ssm_time_step_rank=c.mamba_n_heads, rope_scaling_finetuned=use_rope)
    _tokenizer(w, folder, _padded(c.vocab_size, 8))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, n)
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    for name, data in _checkpoint(folder).items():
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith("block_sparse_moe.input_linear.weight"):
            gate, up = data.split(c.intermediate_size, dim=-2)
            w.add_tensor(f"blk.{bid}.ffn_gate_exps.weight", np.ascontiguousarray(gate.numpy()))
            w.add_tensor(f"blk.{bid}.ffn_up_exps.weight", np.ascontiguousarray(up.numpy()))
            continue
        if name.endswith("shared_mlp.input_linear.weight"):
            gate, up = data.split(c.shared_intermediate_size, dim=-2)
            suffix = "_shexp" if experts else ""
            w.add_tensor(f"blk.{bid}.ffn_gate{suffix}.weight", np.ascontiguousarray(gate.numpy()))
            w.add_tensor(f"blk.{bid}.ffn_up{suffix}.weight", np.ascontiguousarray(up.numpy()))
            continue
        if not experts and name.endswith("shared_mlp.output_linear.weight"):
            w.add_tensor(f"blk.{bid}.ffn_down.weight", np.ascontiguousarray(data.numpy()))
            continue
        if bid is not None and bid not in attn:
            data = _mamba2_tensor(name, data, c.mamba_n_groups, d_inner)
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            data = torch.from_numpy(_permute(data.numpy(), heads))
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            data = torch.from_numpy(_permute(data.numpy(), kv))
        w.add_tensor(_mamba2_name(names, name), np.ascontiguousarray(data.numpy()))
    _finish(w, (), metadata)
    return out


def _granite(tmp: Path, moe: bool = True, rope: bool = False) -> tuple[Any, Path]:
    import transformers as tf

    extra: dict[str, Any] = dict(embedding_multiplier=3.0, attention_multiplier=0.09, residual_multiplier=0.6,
                                 logits_scaling=2.5, tie_word_embeddings=True) if moe else {}
    config = tf.GraniteMoeHybridConfig(
        **{**TINY, "num_hidden_layers": 3 if moe else 2},
        layer_types=["mamba", "attention", "mamba"] if moe else ["attention", "mamba"], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_chunk_size=32, num_local_experts=4 if moe else 0, num_experts_per_tok=2,
        shared_intermediate_size=48, position_embedding_type="rope" if rope else None,
        rope_parameters={"rope_type": "default", "rope_theta": 50_000.0}, **extra)
    return built(tmp, f"granite_{moe}_{rope}", tf.GraniteMoeHybridForCausalLM(config))


def write_bamba(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """A Bamba checkpoint as `GraniteHybridModel` writes it (`BambaForCausalLM` is one of its architectures): the keys
    of the dense Granite 4.0-H (no multipliers: Bamba has none), the rotated dims as the checkpoint's
    `attn_rotary_emb` (over `LlamaModel`'s whole head: the later key stands), `rope.scaling.finetuned` true, the
    context as it is; q / k permuted over the whole head on the attention layers, the MLP (`feed_forward`) and the
    mixer's tensors by gguf's table in Mamba-2's layouts, the tokens padded to a multiple of 8."""
    import gguf
    import torch

    c = model.config
    n = c.num_hidden_layers
    attn = list(c.attn_layer_indices)
    head = c.hidden_size // c.num_attention_heads
    d_inner = c.mamba_expand * c.hidden_size
    w = gguf.GGUFWriter(str(out), "granitehybrid")
    add_text_keys(w, c, block_count=n, head_count_kv=[c.num_key_value_heads if i in attn else 0 for i in range(n)],
                  rope_freq_base=c.rope_parameters["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps,
                  vocab_size=c.vocab_size,
                  rope_dimension_count=int(head * c.rope_parameters["partial_rotary_factor"]),  # (attn_rotary_emb)
                  ssm_conv_kernel=c.mamba_d_conv, ssm_state_size=c.mamba_d_state, ssm_group_count=c.mamba_n_groups,
                  ssm_inner_size=d_inner, ssm_time_step_rank=c.mamba_n_heads, rope_scaling_finetuned=True)
    _tokenizer(w, folder, _padded(c.vocab_size, 8))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, n)
    for name, data in _checkpoint(folder).items():
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if bid is not None and bid not in attn:
            data = _mamba2_tensor(name, data, c.mamba_n_groups, d_inner)
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            data = torch.from_numpy(_permute(data.numpy(), c.num_attention_heads))
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            data = torch.from_numpy(_permute(data.numpy(), c.num_key_value_heads))
        w.add_tensor(_mamba2_name(names, name), np.ascontiguousarray(data.numpy()))
    _finish(w, (), metadata)
    return out


def _bamba(tmp: Path, tied: bool = False) -> tuple[Any, Path]:
    """Bamba's form: Mamba-2 layers with one attention layer, half of each head rotated, a dense MLP everywhere."""
    import transformers as tf

    config = tf.BambaConfig(**{**TINY, "num_hidden_layers": 3}, attn_layer_indices=[1], mamba_n_heads=8,
                            mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=32,
                            tie_word_embeddings=tied)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}
    return built(tmp, f"bamba_{tied}", tf.BambaForCausalLM(config))


def write_falcon_h1(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """As `FalconH1Model` writes it: Mamba2Model's keys with the context, MLP width and heads put back, the vocabulary
    size, KV heads, head size, rotary base; every muP multiplier multiplied into the weights (`modify_tensors`),
    after Mamba-2's layouts; the tokens as they are (`_set_vocab_gpt2`)."""
    import gguf

    c = model.config
    d_inner = c.mamba_d_ssm
    w = gguf.GGUFWriter(str(out), "falcon-h1")
    add_keys(w, embedding_length=c.hidden_size, ssm_conv_kernel=c.mamba_d_conv, ssm_inner_size=d_inner,
             ssm_state_size=c.mamba_d_state, ssm_time_step_rank=d_inner // c.mamba_d_head,
             ssm_group_count=c.mamba_n_groups, layer_norm_rms_eps=c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, c.num_hidden_layers)
    gs = c.mamba_n_groups * c.mamba_d_state
    for name, data in _checkpoint(folder).items():
        data = _mamba2_tensor(name, data, c.mamba_n_groups, d_inner)
        if "down_proj" in name:
            data = data * c.mlp_multipliers[1]
        elif "gate_proj" in name:
            data = data * c.mlp_multipliers[0]
        elif "k_proj" in name:
            data = data * c.key_multiplier * c.attention_in_multiplier
        elif "q_proj" in name or "v_proj" in name:
            data = data * c.attention_in_multiplier
        elif "o_proj" in name:
            data = data * c.attention_out_multiplier
        elif "out_proj" in name:
            data = data * c.ssm_out_multiplier
        elif "in_proj" in name:
            data = data * c.ssm_in_multiplier
            m = c.ssm_multipliers
            data[:d_inner] *= m[0]
            data[d_inner:2 * d_inner] *= m[1]
            data[2 * d_inner:2 * d_inner + gs] *= m[2]
            data[2 * d_inner + gs:2 * d_inner + 2 * gs] *= m[3]
            data[2 * d_inner + 2 * gs:] *= m[4]
        elif "lm_head" in name:
            data = data * c.lm_head_multiplier
        elif "embed_tokens" in name:
            data = data * c.embedding_multiplier
        w.add_tensor(_mamba2_name(names, name), np.ascontiguousarray(data.numpy()))
    _finish(w, (), metadata)
    return out


def _falcon_h1(tmp: Path, norm: bool = True) -> tuple[Any, Path]:
    import transformers as tf

    mup = dict(embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.7, attention_in_multiplier=0.8,
               attention_out_multiplier=1.3, ssm_in_multiplier=1.2, ssm_out_multiplier=0.75,
               mlp_multipliers=[0.9, 1.1], ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3]) if norm else \
        dict(tie_word_embeddings=True, mlp_multipliers=[1.5, 0.6])
    config = tf.FalconH1Config(**TINY, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
                               mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=32, mamba_rms_norm=norm,
                               mamba_norm_before_gate=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 100_000.0}, **mup)
    return built(tmp, f"falcon_h1_{norm}", tf.FalconH1ForCausalLM(config))


CASES = {
    "mamba2": (_mamba2, write_mamba2),
    "mamba2_tied_padded_vocab": (lambda tmp: _mamba2(tmp, tied=True, vocab=328), write_mamba2),
    "granite_4_h_moe_nope": (_granite, write_granite_hybrid),
    "granite_4_h_dense_rope": (lambda tmp: _granite(tmp, moe=False, rope=True), write_granite_hybrid),
    "falcon_h1": (_falcon_h1, write_falcon_h1),
    "falcon_h1_no_norm_tied": (lambda tmp: _falcon_h1(tmp, norm=False), write_falcon_h1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_mamba2_family_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    make, write = CASES[name]
    hf, folder = make(tmp_path)
    assert read_back(hf, write(hf, folder, tmp_path / f"{name}.gguf")) <= 1e-4


def test_a_granite_hybrid_rotating_part_of_a_head_not_in_bambas_form_is_refused(tmp_path: Path) -> None:
    """A Granite 4.0-H file (its multipliers written: attention.scale 1) rotating half a head: not Bamba's form, and
    transformers' Granite 4.0-H rotates whole heads."""
    hf, folder = _granite(tmp_path, moe=False, rope=True)
    path = write_granite_hybrid(hf, folder, tmp_path / "granite_partial.gguf",
                                metadata={"granitehybrid.rope.dimension_count": 8})
    with pytest.raises(UnsupportedModelError, match="rope.dimension_count 8"):
        read_back(hf, path)


@pytest.mark.parametrize("tied", [False, True])
def test_a_bamba_gguf_is_the_bamba_checkpoint(tmp_path: Path, tied: bool) -> None:
    """A Bamba checkpoint's file (half of each head rotated, q / k rows permuted over the whole head by the
    converter) reads as transformers' Bamba with the checkpoint's rows: its model."""
    from llmc.export.sources import load, resolve

    hf, folder = _bamba(tmp_path, tied)
    path = write_bamba(hf, folder, tmp_path / "bamba.gguf")
    assert load(resolve(str(path))).model.config.model_type == "bamba"
    assert read_back(hf, path) <= 1e-4
