"""DeepSeek-V2 (-Lite) and DeepSeek-V3 GGUF files as llama.cpp's `DeepseekV2Model` writes them, read back to the
logits of the checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_deepseek2(model: Any, folder: Path, out: Path, scoring: str | None, metadata: dict[str, Any] | None = None,
                    split_kv_b: bool = True, arch: str = "deepseek2", table: str | None = None, appended: int = 0,
                    more_keys: Callable[[Any, dict[str, Any]], None] | None = None) -> Path:
    """`TextModel`'s keys with one KV head (the checkpoint's config.json `scoring_func` among them), then the
    latent ranks and heads' sizes, the leading dense layers, the experts' keys, the rotated dims, yarn's
    0.1 x mscale_all_dim; `kv_b_proj` split into `attn_k_b` ([H, rank, nope]) and `attn_v_b` ([H, v, rank]) (or
    whole, as older converters wrote it), the selection bias as `exp_probs_b.bias`, the experts stacked. Its
    subclasses' files: `arch` (by `table`'s names), `appended` blocks counted in `block_count`, `more_keys` after."""
    c = model.config

    def keys(w: Any, h: dict[str, Any]) -> None:
        h = {**h, "num_key_value_heads": 1, "scoring_func": scoring}
        text_keys(w, {**h, "num_hidden_layers": h["num_hidden_layers"] + appended})
        w.add_leading_dense_block_count(h["first_k_dense_replace"])
        w.add_vocab_size(h["vocab_size"])
        if h.get("q_lora_rank") is not None:
            w.add_q_lora_rank(h["q_lora_rank"])
        w.add_kv_lora_rank(h["kv_lora_rank"])
        w.add_key_length(h["kv_lora_rank"] + h["qk_rope_head_dim"])
        w.add_value_length(h["kv_lora_rank"])
        w.add_key_length_mla(h["qk_nope_head_dim"] + h["qk_rope_head_dim"])
        w.add_value_length_mla(h["v_head_dim"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_count(h["n_routed_experts"])
        w.add_expert_shared_count(h["n_shared_experts"])
        w.add_expert_weights_scale(h["routed_scaling_factor"])
        if h.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(h["qk_rope_head_dim"])
        if (mscale := (h.get("rope_parameters") or {}).get("mscale_all_dim")) is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * mscale)
        if more_keys is not None:
            more_keys(w, h)

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
        if name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = values.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            return [(f"{blk}.attn_k_b.weight", kv_b[:, :c.qk_nope_head_dim].transpose(0, 2, 1)),
                    (f"{blk}.attn_v_b.weight", kv_b[:, c.qk_nope_head_dim:])]
        if name.endswith("e_score_correction_bias"):
            return [(f"{blk}.exp_probs_b.bias", values)]
        return None

    return write_moe(model, folder, out, arch, keys, transform, metadata=metadata, table=table)


MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8,
           num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1, n_shared_experts=2)


def _v2(tmp: Path) -> tuple[Any, Path]:
    """V2-Lite's form: no query rank, softmax routing without renormalizing, one group, yarn."""
    import transformers as tf

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    config = tf.DeepseekV2Config(**{**TINY, "num_hidden_layers": 3, "num_key_value_heads": 4}, **MLA, q_lora_rank=None,
                                 n_group=1, topk_group=1, topk_method="greedy", rope_parameters=rope)
    return built(tmp, "deepseek_v2", tf.DeepseekV2ForCausalLM(config))


def _v3(tmp: Path) -> tuple[Any, Path]:
    """V3's form: a query rank, sigmoid routing with a selection bias in groups, renormalized and scaled, yarn."""
    import torch
    import transformers as tf

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = tf.DeepseekV3Config(**{**TINY, "num_hidden_layers": 3, "num_key_value_heads": 4}, **MLA, q_lora_rank=40,
                                 n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                 rope_interleave=True, rope_parameters=rope)
    model = tf.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    return built(tmp, "deepseek_v3", model)


@pytest.mark.parametrize("split_kv_b", [True, False])
def test_deepseek_v2_lite_reads_back_as_its_checkpoint(tmp_path: Path, split_kv_b: bool) -> None:
    hf, folder = _v2(tmp_path)
    path = write_deepseek2(hf, folder, tmp_path / "v2.gguf", "softmax", split_kv_b=split_kv_b)
    assert read_back(hf, path) <= 1e-4


def test_deepseek_v3_reads_back_as_its_checkpoint(tmp_path: Path) -> None:
    hf, folder = _v3(tmp_path)
    assert read_back(hf, write_deepseek2(hf, folder, tmp_path / "v3.gguf", "sigmoid")) <= 1e-4


def test_deepseek_softmax_routing_in_groups_is_refused(tmp_path: Path) -> None:
    """DeepSeek-V2 (236B)'s: llama.cpp scores its groups as V3 does, not by their best expert as V2 does."""
    from llmc.export.sources import load, resolve

    hf, folder = _v2(tmp_path)
    path = write_deepseek2(hf, folder, tmp_path / "v2.gguf", "softmax",
                           metadata={"deepseek2.expert_group_count": 4, "deepseek2.expert_group_used_count": 2})
    with pytest.raises(UnsupportedModelError, match="expert_group_count"):
        load(resolve(str(path)))
