"""GGUF files of Nemotron-H (dense) and its mixture form written as llama.cpp's converter writes them
(`NemotronHModel`, a `GraniteHybridModel`), from the checkpoint the tiny model saved, read back to its logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import _finish, _permute, _tokenizer, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_ssm_mamba2 import _checkpoint, _mamba2_name, _mamba2_tensor, _padded

_KINDS = {"linear_attention": "M", "mlp": "-", "full_attention": "*", "moe": "E"}


def write_nemotron_h(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                     mtp: bool = False, attention_multiplier: float | None = None) -> Path:
    """As `NemotronHModel` writes it: `nemotron_h_moe` where the pattern has experts (the published configs name
    `num_experts_per_tok` only then); TextModel's keys (no head size: Granite pops it; the RMS and LayerNorm epsilon
    keys, both the checkpoints' one value; the expert and group counts), LlamaModel's vocabulary size and rotated
    dims (hidden / heads), GraniteHybridModel's mixer keys, per-layer KV heads (0 off the attention layers),
    `rope.scaling.finetuned` false and context 2**20, Nemotron-H's head size and per-layer feed-forward widths (0
    off the MLP / mixture layers) and the mixture's keys; the token list padded to a multiple of 8. Tensors: the
    mixer's in Mamba-2's layouts (dt_bias as `dt_proj.bias`, or `dt.bias` on the mixture path), q / k permuted, each
    layer's experts stacked per projection, the router's correction bias as `e_score_correction.bias`. `mtp`: a
    multi-token-prediction block appended as the converter folds a checkpoint's `mtp.*` (attention and mixture in one
    block, `nextn_predict_layers` 1), its values made up. `attention_multiplier`: as Granite's converter writes a
    checkpoint's (`attention.scale`)."""
    import gguf
    import torch

    c = model.config
    types = list(c.layers_block_type)
    moe = "moe" in types
    n = len(types) + (1 if mtp else 0)
    attn = [i for i, t in enumerate(types) if t == "full_attention"] + ([n - 1] if mtp else [])
    ssm = [i for i, t in enumerate(types) if t == "linear_attention"]
    mlp = [i for i, t in enumerate(types) if t == ("moe" if moe else "mlp")] + ([n - 1] if mtp else [])
    d_inner = c.mamba_num_heads * c.mamba_head_dim
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if moe else gguf.MODEL_ARCH.NEMOTRON_H
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n)
    w.add_context_length(2**20)
    w.add_embedding_length(c.hidden_size)
    width = c.moe_intermediate_size if moe else c.intermediate_size
    w.add_feed_forward_length([width if i in mlp else 0 for i in range(n)])
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if i in attn else 0 for i in range(n)])
    w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    if moe:
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if attention_multiplier:
        w.add_attention_scale(attention_multiplier)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.ssm_state_size)
    w.add_ssm_group_count(c.n_groups)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_time_step_rank(c.mamba_num_heads)
    w.add_rope_scaling_finetuned(False)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if moe:
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        if c.moe_latent_size is not None:
            w.add_moe_latent_size(c.moe_latent_size)
        if mtp:
            w.add_nextn_predict_layers(1)
    _tokenizer(w, folder, _padded(c.vocab_size, 8))
    if not moe:
        w.add_add_bos_token(True)
    names = gguf.get_tensor_name_map(arch, n)
    experts: dict[int, dict[str, Any]] = {}
    for name, data in _checkpoint(folder).items():
        bid = int(name.split(".")[2]) if name.startswith("backbone.layers.") else None
        if moe and bid is not None:  # (NemotronHModel.modify_tensors' mixture path, then GraniteHybridModel's)
            if name.endswith("mixer.gate.e_score_correction_bias"):
                name = name.replace("e_score_correction_bias", "e_score_correction.bias")
            elif name.endswith("mixer.dt_bias"):
                name = name.replace("dt_bias", "dt.bias")
            elif name.endswith(("mixer.conv1d.weight", "mixer.A_log", "mixer.D", "mixer.norm.weight")):
                data = _mamba2_tensor(name, data, c.n_groups, d_inner)
            elif ".mixer.experts." in name:
                experts.setdefault(bid, {})[name] = data
                if len(experts[bid]) == 2 * c.n_routed_experts:
                    for kind in ("down_proj", "up_proj"):
                        stacked = torch.stack([experts[bid][f"backbone.layers.{bid}.mixer.experts.{x}.{kind}.weight"]
                                               for x in range(c.n_routed_experts)])
                        merged = f"model.layers.{bid}.mlp.experts.{kind}.weight"
                        w.add_tensor(str(names.get_name(merged, try_suffixes=(".weight",))),
                                     np.ascontiguousarray(stacked.numpy()))
                continue
        elif bid in ssm:  # (GraniteHybridModel -> Mamba2Model.modify_tensors)
            data = _mamba2_tensor(name, data, c.n_groups, d_inner)
        if bid in attn and name.endswith("q_proj.weight"):  # (-> LlamaModel.modify_tensors, undo_permute)
            data = torch.from_numpy(_permute(data.numpy(), c.num_attention_heads))
        elif bid in attn and name.endswith("k_proj.weight"):
            data = torch.from_numpy(_permute(data.numpy(), c.num_key_value_heads))
        w.add_tensor(_mamba2_name(names, name), np.ascontiguousarray(data.numpy()))
    extra: dict[str, np.ndarray] = {}
    if mtp:  # (made-up values in the shapes of the converter's folded MTP block)
        rng = np.random.default_rng(0)
        h, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
        e, i, sh = c.n_routed_experts, c.moe_intermediate_size, c.moe_shared_expert_intermediate_size
        lat = c.moe_latent_size or h
        shapes = {"attn_norm.weight": (h,), "attn_q.weight": (c.num_attention_heads * c.head_dim, h),
                  "attn_k.weight": (kv, h), "attn_v.weight": (kv, h),
                  "attn_output.weight": (h, c.num_attention_heads * c.head_dim), "ffn_gate_inp.weight": (e, h),
                  "exp_probs_b.bias": (e,), "ffn_up_exps.weight": (e, i, lat), "ffn_down_exps.weight": (e, lat, i),
                  "ffn_up_shexp.weight": (sh, h), "ffn_down_shexp.weight": (h, sh),
                  "nextn.eh_proj.weight": (h, 2 * h), "nextn.enorm.weight": (h,), "nextn.hnorm.weight": (h,),
                  "nextn.shared_head_norm.weight": (h,)}
        if c.moe_latent_size is not None:
            shapes.update({"ffn_latent_down.weight": (lat, h), "ffn_latent_up.weight": (h, lat)})
        extra = {f"blk.{n - 1}.{k}": rng.normal(0, 0.1, s).astype(np.float32) for k, s in shapes.items()}
    _finish(w, (), metadata, extra)
    return out


def _nemotron_h(tmp: Path, moe: bool = False, latent: int | None = None, groups: int = 1,
                vocab: int = 320) -> tuple[Any, Path]:
    import torch
    import transformers as tf

    mixture = "moe" if moe else "mlp"
    types = ["linear_attention", mixture, "full_attention", mixture, "linear_attention", mixture]
    config = tf.NemotronHConfig(
        vocab_size=vocab, hidden_size=64, layers_block_type=types, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
        conv_kernel=4, chunk_size=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, moe_latent_size=latent, n_group=groups, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=2**20,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = tf.NemotronHForCausalLM(config)
    with torch.no_grad():  # (a buffer: built() moves parameters only)
        for layer in model.model.layers:
            if layer.block_type == "moe":
                layer.mixer.gate.e_score_correction_bias.normal_(0, 0.2)
    return built(tmp, f"nemotron_h_{moe}_{latent}_{groups}_{vocab}", model)


CASES = {
    "nemotron_h_dense_padded_vocab": (lambda tmp: _nemotron_h(tmp, vocab=322), write_nemotron_h),
    "nemotron_h_moe": (lambda tmp: _nemotron_h(tmp, moe=True), write_nemotron_h),
    "nemotron_h_moe_latent_groups": (lambda tmp: _nemotron_h(tmp, moe=True, latent=24, groups=2), write_nemotron_h),
    "nemotron_h_moe_latent_mtp": (lambda tmp: _nemotron_h(tmp, moe=True, latent=24),
                                  lambda hf, folder, out: write_nemotron_h(hf, folder, out, mtp=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_nemotron_h_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    make, write = CASES[name]
    hf, folder = make(tmp_path)
    assert read_back(hf, write(hf, folder, tmp_path / f"{name}.gguf")) <= 1e-4


def test_a_nemotron_h_layer_pattern_is_read_from_the_per_layer_arrays(tmp_path: Path) -> None:
    from llmc.export.gguf_read import config_for

    hf, folder = _nemotron_h(tmp_path, moe=True, latent=24)
    config = config_for(write_nemotron_h(hf, folder, tmp_path / "mtp.gguf", mtp=True))
    assert config is not None
    assert config.layers_block_type == hf.config.layers_block_type
    assert (config.moe_latent_size, config.routed_scaling_factor, config.norm_topk_prob) == (24, 2.5, True)


def test_a_nemotron_h_attention_scale_of_its_own_is_refused(tmp_path: Path) -> None:
    hf, folder = _nemotron_h(tmp_path)
    path = write_nemotron_h(hf, folder, tmp_path / "scaled.gguf", attention_multiplier=0.5)
    with pytest.raises(UnsupportedModelError, match="attention.scale 0.5"):
        read_back(hf, path)


def test_a_nemotron_h_layer_with_attention_and_an_mlp_is_refused(tmp_path: Path) -> None:
    hf, folder = _nemotron_h(tmp_path)
    path = write_nemotron_h(hf, folder, tmp_path / "both.gguf",
                            metadata={"nemotron_h.attention.head_count_kv": [0, 2, 2, 0, 0, 0]})
    with pytest.raises(UnsupportedModelError, match="layer 1 has both KV heads"):
        read_back(hf, path)


def test_a_nemotron_h_moe_gguf_holds_the_checkpoints_weights(tmp_path: Path) -> None:
    """Every weight as the checkpoint has it: q / k rows unpermuted too (without rotary the logits do not show
    their order)."""
    from llmc.export.sources import load, resolve

    hf, folder = _nemotron_h(tmp_path, moe=True, latent=24)
    ours = load(resolve(str(write_nemotron_h(hf, folder, tmp_path / "weights.gguf")))).model.state_dict()
    theirs = hf.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in theirs) <= 1e-6
