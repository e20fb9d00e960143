"""Kimi Linear GGUF files as llama.cpp's `KimiLinearModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import write_moe


def write_kimi_linear(model: Any, folder: Path, out: Path, legacy: bool = False,
                      metadata: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys with one KV head (the converter's MQA form of MLA), then the vocabulary size, the KV heads per
    layer (1 on the full-attention layers, 0 on KDA), the convolution, KDA head size, the MLA ranks, rotary dims,
    key_length (kv_lora_rank + rope), the MLA key / value head sizes, the experts' width, shared count, leading dense
    layers and routed scale; sigmoid gating (`moe_router_activation_func`). Tensors from the checkpoint's own
    layouts (q / k / v convolutions apart, [channels, 1, kernel]; experts per expert): each convolution as
    [1, channels, 1, kernel], A as -exp(A_log), dt_bias as `dt_proj.bias`, kv_b_proj split per head into k_b
    (transposed) and v_b (`legacy`: whole, the first converter's), the correction bias as `exp_probs_b.bias`, the
    experts stacked."""
    import gguf

    c = model.config
    dense = c.mlp_layer_types.count("dense")
    kernel, width = c.linear_conv_kernel_dim, c.linear_head_dim * c.linear_num_heads

    def keys(w: Any, h: dict[str, Any]) -> None:
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(1)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_vocab_size(c.vocab_size)
        w.add_head_count_kv([1 if t == "full_attention" else 0 for t in c.layer_types])
        w.add_ssm_conv_kernel(kernel)
        w.add_kda_head_dim(c.linear_head_dim)
        if c.q_lora_rank is not None:
            w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_leading_dense_block_count(dense)
        w.add_expert_weights_scale(c.routed_scaling_factor)

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else None
        if name.endswith("self_attn.conv1d.weight"):  # (the checkpoint's q_conv1d, k_conv1d, v_conv1d)
            return [(f"{blk}.ssm_conv1d_{x}.weight", part.reshape(1, width, 1, kernel))
                    for x, part in zip("qkv", np.split(values, 3))]
        if name.endswith("forget_gate.A_log"):
            return [(f"{blk}.ssm_a", -np.exp(values))]
        if name.endswith("forget_gate.dt_bias"):
            return [(f"{blk}.ssm_dt.bias", values)]
        if name.endswith(("forget_gate.f_a_proj.weight", "forget_gate.f_b_proj.weight")):
            return [(f"{blk}.ssm_f_{name.split('.')[-2][2]}.weight", values)]
        if name.endswith("e_score_correction_bias"):
            return [(f"{blk}.exp_probs_b.bias", values)]
        if name.endswith("kv_b_proj.weight"):
            if legacy:
                return [(f"{blk}.attn_kv_b.weight", values)]
            heads, nope = c.num_attention_heads, c.qk_nope_head_dim
            kv = values.reshape(heads, nope + c.v_head_dim, values.shape[-1])
            return [(f"{blk}.attn_k_b.weight", kv[:, :nope].transpose(0, 2, 1)), (f"{blk}.attn_v_b.weight", kv[:, nope:])]
        return None

    return write_moe(model, folder, out, "kimi-linear", keys, transform, metadata=metadata)


def _kimi(tmp: Path, layers: int = 4, full: tuple[int, ...] = (4,), dense: int = 1, q_lora: int | None = None,
          shared: int = 1) -> tuple[Any, Path]:
    """Kimi-Linear-48B-A3B's form, tiny: KDA layers with an MLA layer every fourth (1-based, as its
    `linear_attn_config`), the first layer dense, one shared expert, a correction bias, a routed scale, an untied
    head; MLA without a query rank (`q_lora`: with one)."""
    import torch
    import transformers as tf

    kda = [i for i in range(1, layers + 1) if i not in full]
    config = tf.KimiLinearConfig(
        **{**TINY, "num_hidden_layers": layers}, kv_lora_rank=16, q_lora_rank=q_lora, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
        num_shared_experts=shared, routed_scaling_factor=2.446, first_k_dense_replace=dense,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                            "full_attn_layers": list(full), "kda_layers": kda})
    model = tf.KimiLinearForCausalLM(config)
    with torch.no_grad():  # (a buffer: built() moves parameters only)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.2)
    return built(tmp, f"kimi_{layers}_{full}_{dense}_{q_lora}_{shared}", model)


CASES = {
    "published_form": (dict(), dict()),
    "legacy_kv_b": (dict(), dict(legacy=True)),
    "two_mla_layers_query_rank": (dict(layers=5, full=(2, 5), q_lora=20), dict()),
    "two_shared_experts_no_dense": (dict(dense=0, shared=2), dict()),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_kimi_linear_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    form, writing = CASES[name]
    hf, folder = _kimi(tmp_path, **form)
    assert read_back(hf, write_kimi_linear(hf, folder, tmp_path / f"{name}.gguf", **writing)) <= 1e-4


def test_a_kimi_linear_gguf_holds_the_checkpoints_weights(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _kimi(tmp_path, layers=5, full=(2, 5), q_lora=20)
    loaded = load(resolve(str(write_kimi_linear(hf, folder, tmp_path / "weights.gguf"))))
    config = loaded.model.config
    assert (config.layer_types, config.mlp_layer_types) == (hf.config.layer_types, hf.config.mlp_layer_types)
    assert config.num_key_value_heads == hf.config.num_attention_heads
    ours, theirs = loaded.model.state_dict(), hf.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in theirs) <= 1e-6


@pytest.mark.parametrize("metadata,match", [
    ({"kimi-linear.expert_gating_func": 1}, "expert_gating_func"),
    ({"kimi-linear.kda.head_dim": 8}, "kda.head_dim"),
])
def test_a_kimi_linear_file_llmc_cannot_read_faithfully_is_refused(tmp_path: Path, metadata: dict[str, Any],
                                                                   match: str) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _kimi(tmp_path)
    path = write_kimi_linear(hf, folder, tmp_path / "refused.gguf", metadata=metadata)
    with pytest.raises(UnsupportedModelError, match=match):
        load(resolve(str(path)))
