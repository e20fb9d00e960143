"""GGUF files of Qwen3.5 and Qwen3.5-MoE written as llama.cpp's converter writes them (`Qwen3_5TextModel`,
`Qwen3_5MoeTextModel`: `_LinearAttentionVReorderBase` over `Qwen3NextModel` over `Qwen2MoeModel`), from the
checkpoint the tiny model saved, read back to its logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import _finish, _tokenizer, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_ssm_mamba2 import _checkpoint


def _reorder_v_heads(t: Any, dim: int, k_heads: int, per_key: int, size: int) -> Any:
    """The converter's `_LinearAttentionVReorderBase._reorder_v_heads`: grouped by key head -> tiled."""
    shape = list(t.shape)
    if dim < 0:
        dim += len(shape)
    t = t.reshape(*shape[:dim], k_heads, per_key, size, *shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def _v_reorder(name: str, data: Any, c: Any) -> Any:
    """`_LinearAttentionVReorderBase.modify_tensors` (where the value heads outnumber the key heads)."""
    import torch

    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    if not (nk != nv and "linear_attn." in name):
        return data
    dk, dv, r = c.linear_key_head_dim, c.linear_value_head_dim, nv // nk
    if ".in_proj_qkv." in name:
        qk = 2 * dk * nk
        return torch.cat([data[:qk], _reorder_v_heads(data[qk:], 0, nk, r, dv)], dim=0)
    if ".in_proj_z." in name:
        return _reorder_v_heads(data, 0, nk, r, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return _reorder_v_heads(data, 0, nk, r, 1)
    if ".A_log" in name or ".dt_bias" in name or ".dt_proj" in name:
        return _reorder_v_heads(data.unsqueeze(-1), 0, nk, r, 1).squeeze(-1)
    if ".conv1d" in name:
        data = data.squeeze()
        qk = 2 * dk * nk
        return torch.cat([data[:qk], _reorder_v_heads(data[qk:], 0, nk, r, dv)], dim=0)
    if ".out_proj." in name:
        return _reorder_v_heads(data, 1, nk, r, dv)
    return data


def _interval(types: list[str]) -> int:
    """The checkpoint's `full_attention_interval` (published configs carry it beside layer_types)."""
    return next(i for i in range(1, len(types) + 1) if types == [
        "linear_attention" if (j + 1) % i else "full_attention" for j in range(len(types))])


def write_qwen35(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                 mtp: bool = False) -> Path:
    """As `Qwen3_5TextModel` / `Qwen3_5MoeTextModel` write it. Keys: TextModel's (block count with the MTP block,
    context, width, the dense MLP's width, heads, KV heads, M-RoPE sections, rotary base, RMS epsilon, expert count
    and top-k, head size), Qwen2MoeModel's expert widths, Qwen3NextModel's mixer keys, interval and rotated dims, the
    MTP mixin's `nextn_predict_layers`. Tensors: the V-head reorder, then A as -exp(A_log), dt_bias as
    `dt_proj.bias`, conv1d squeezed, every norm but the Gated DeltaNet's as 1 + w, then the experts stacked per
    projection. `mtp`: a multi-token-prediction block appended as the converter maps a checkpoint's `mtp.*`, its
    values made up."""
    import gguf
    import torch

    c = model.config
    moe = c.model_type == "qwen3_5_moe_text"
    arch = gguf.MODEL_ARCH.QWEN35MOE if moe else gguf.MODEL_ARCH.QWEN35
    n = c.num_hidden_layers + (1 if mtp else 0)
    rope = dict(c.rope_parameters)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n)  # (TextModel.set_gguf_parameters)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if not moe:
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if key in rope:
                add(rope[key])
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0, 0, 0, 0])[:4])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if moe:  # (Qwen2MoeModel)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)  # (Qwen3NextModel)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(_interval(list(c.layer_types)))
    w.add_rope_dimension_count(int(c.head_dim * rope.get("partial_rotary_factor", 0.25)))
    if "mrope_section" not in rope:  # (_Qwen35MRopeMixin)
        w.add_rope_dimension_sections([11, 11, 10, 0])
    if mtp:  # (_Qwen35MtpMixin)
        w.add_nextn_predict_layers(1)
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(arch, n)
    stacks: dict[int, dict[str, Any]] = {}
    for name, data in _checkpoint(folder).items():
        data = _v_reorder(name, data, c)
        if name.endswith(".A_log"):  # (Qwen3NextModel.modify_tensors)
            data = -torch.exp(data)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            data = data.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            data = data + 1
        if ".mlp.experts." in name:  # (Qwen2MoeModel.modify_tensors: each layer's experts stacked)
            bid = int(name.split(".")[2])
            stacks.setdefault(bid, {})[name] = data
            if len(stacks[bid]) < 3 * c.num_experts:
                continue
            for kind in ("down_proj", "gate_proj", "up_proj"):
                stacked = torch.stack([stacks[bid][f"model.layers.{bid}.mlp.experts.{x}.{kind}.weight"]
                                       for x in range(c.num_experts)])
                mapped = names.get_name(f"model.layers.{bid}.mlp.experts.{kind}.weight", try_suffixes=(".weight",))
                w.add_tensor(str(mapped), np.ascontiguousarray(stacked.numpy()))
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        w.add_tensor(mapped, np.ascontiguousarray(data.numpy()))
    extra: dict[str, np.ndarray] = {}
    if mtp:  # (made-up values in the shapes of the converter's MTP block: a full-attention layer and nextn's)
        rng = np.random.default_rng(0)
        h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "attn_norm.weight": (h,), "post_attention_norm.weight": (h,), "attn_q.weight": (2 * q, h),
            "attn_k.weight": (kv, h), "attn_v.weight": (kv, h), "attn_output.weight": (h, q),
            "attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,),
            "nextn.eh_proj.weight": (h, 2 * h), "nextn.enorm.weight": (h,), "nextn.hnorm.weight": (h,),
            "nextn.shared_head_norm.weight": (h,)}
        if moe:
            e, i, s = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            shapes.update({"ffn_gate_inp.weight": (e, h), "ffn_gate_exps.weight": (e, i, h),
                           "ffn_up_exps.weight": (e, i, h), "ffn_down_exps.weight": (e, h, i),
                           "ffn_gate_shexp.weight": (s, h), "ffn_up_shexp.weight": (s, h),
                           "ffn_down_shexp.weight": (h, s), "ffn_gate_inp_shexp.weight": (1, h)})
        else:
            i = c.intermediate_size
            shapes.update({"ffn_gate.weight": (i, h), "ffn_up.weight": (i, h), "ffn_down.weight": (h, i)})
        extra = {f"blk.{n - 1}.{k}": rng.normal(0, 0.1, s).astype(np.float32) for k, s in shapes.items()}
    _finish(w, (), metadata, extra)
    return out


_BASE = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=256, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


def _qwen35(tmp: Path, moe: bool = False, k_heads: int = 2, v_heads: int = 2, dk: int = 16, dv: int = 16,
            layers: int = 4, interval: int = 4, partial: float = 0.25, tied: bool = False,
            sections: list[int] | None = None, yarn: float | None = None) -> tuple[Any, Path]:
    import transformers as tf

    types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": partial}
    if sections is not None:
        rope.update(mrope_section=sections, mrope_interleaved=True)
    if yarn:  # (the published cards' long-context form)
        rope.update(rope_type="yarn", factor=yarn, original_max_position_embeddings=64)
    fields = dict(_BASE, num_hidden_layers=layers, layer_types=types, rope_parameters=rope,
                  linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=dk,
                  linear_value_head_dim=dv, tie_word_embeddings=tied)
    if moe:
        config = tf.Qwen3_5MoeTextConfig(**fields, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48)
        model = tf.Qwen3_5MoeForCausalLM(config)
    else:
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**fields, intermediate_size=96))
    name = f"qwen35_{moe}_{k_heads}_{v_heads}_{dk}_{dv}_{layers}_{interval}_{partial}_{tied}_{yarn}"
    return built(tmp, name, model)


CASES = {
    # Qwen3.5-0.8B / 2B's form: as many value heads as key heads, the head tied, M-RoPE sections given
    "qwen35_tied_equal_heads": (lambda tmp: _qwen35(tmp, tied=True, sections=[2, 1, 1]), write_qwen35),
    # 9B / 27B's: twice the value heads (the V-head reorder), value heads wider than the key heads; the MTP block
    "qwen35_more_value_heads_mtp": (lambda tmp: _qwen35(tmp, v_heads=4, dv=24),
                                    lambda hf, folder, out: write_qwen35(hf, folder, out, mtp=True)),
    # 35B-A3B / 397B-A17B's: experts, shared expert and its gate, value heads 3 x the key heads; half the head rotated,
    # full attention every second layer
    "qwen35moe_more_value_heads": (lambda tmp: _qwen35(tmp, moe=True, v_heads=6, layers=6, interval=2,
                                                       partial=0.5), write_qwen35),
    # the cards' YaRN for long contexts
    "qwen35moe_yarn_mtp": (lambda tmp: _qwen35(tmp, moe=True, v_heads=4, sections=[2, 1, 1], yarn=4.0),
                      lambda hf, folder, out: write_qwen35(hf, folder, out, mtp=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_qwen35_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    make, write = CASES[name]
    hf, folder = make(tmp_path)
    assert read_back(hf, write(hf, folder, tmp_path / f"{name}.gguf")) <= 1e-4


@pytest.mark.parametrize("moe", [False, True])
def test_a_qwen35_gguf_holds_the_checkpoints_weights(tmp_path: Path, moe: bool) -> None:
    """Every weight as the checkpoint has it (the value heads' order, the norms less 1, A_log, the experts)."""
    from llmc.export.sources import load, resolve

    hf, folder = _qwen35(tmp_path, moe=moe, v_heads=4, dv=24)
    ours = load(resolve(str(write_qwen35(hf, folder, tmp_path / "weights.gguf", mtp=True)))).model
    theirs = hf.state_dict()
    mine = ours.state_dict()
    assert sorted(mine) == sorted(theirs)
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in theirs) <= 1e-5
    assert ours.config.layer_types == hf.config.layer_types
    assert ours.config.rope_parameters["partial_rotary_factor"] == 0.25


def test_a_qwen35_value_length_of_its_own_is_refused(tmp_path: Path) -> None:
    hf, folder = _qwen35(tmp_path)
    path = write_qwen35(hf, folder, tmp_path / "v.gguf", metadata={"qwen35.attention.value_length": 16})
    with pytest.raises(UnsupportedModelError, match="attention.value_length 16"):
        read_back(hf, path)


def test_a_qwen35_value_heads_not_a_multiple_of_the_key_heads_are_refused(tmp_path: Path) -> None:
    hf, folder = _qwen35(tmp_path, v_heads=4)
    path = write_qwen35(hf, folder, tmp_path / "heads.gguf", metadata={"qwen35.ssm.group_count": 3})
    with pytest.raises(UnsupportedModelError, match="ssm.group_count"):
        read_back(hf, path)


def test_a_qwen35moe_gguf_exports(tmp_path: Path) -> None:
    """The whole route: a Qwen3.5-MoE file (value heads reordered, an MTP block) to an export and its engine, which
    computes the logits of the checkpoint the file came from."""
    import torch

    from llmc.engines.ort.build import export_engine
    from llmc.export.exporter import ExportConfig, export

    hf, folder = _qwen35(tmp_path, moe=True, v_heads=4, dv=24, sections=[2, 1, 1])
    manifest = export(ExportConfig(str(write_qwen35(hf, folder, tmp_path / "q.gguf", mtp=True)), tmp_path / "export"))
    engine = export_engine(manifest, tmp_path / "export")
    ids = np.random.default_rng(1).integers(3, 320, 40).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
    assert float(np.abs(engine.prefill([0], [ids], engine.new_kv_cache(1, 128))[0] - ref).max()) <= 1e-4
