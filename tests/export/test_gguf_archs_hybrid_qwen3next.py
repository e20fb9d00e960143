"""Qwen3-Next GGUF files as llama.cpp's `Qwen3NextModel` (a `Qwen2MoeModel`) writes them, read back to the logits of
the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def _interval(types: list[str]) -> int:
    """The checkpoint's `full_attention_interval` (its layer_types are that pattern)."""
    return types.index("full_attention") + 1


def write_qwen3next(model: Any, folder: Path, out: Path, legacy: bool = False, fused: bool = False,
                    metadata: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys, `Qwen2MoeModel`'s experts' and shared expert's widths, then the delta-net's `ssm.*` keys,
    the full-attention interval and the rotated dims (head size x partial_rotary_factor); tensors: A as -exp(A_log),
    dt_bias as `dt_proj.bias`, the convolution squeezed, every `*norm.weight` but the delta-net's + 1, in_proj_qkvz
    de-interleaved into `attn_qkv` and `attn_gate` (`legacy`: as it is, `ssm_in`, the first converter's), the
    experts stacked per projection (`fused`: gate and up as one `ffn_gate_up_exps`, `--fuse-gate-up-exps`)."""
    c = model.config
    dk, dv, nk, nv = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_key_heads, c.linear_num_value_heads
    rope = c.rope_parameters

    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, h)
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(h["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(h["linear_conv_kernel_dim"])
        w.add_ssm_state_size(dk)
        w.add_ssm_group_count(nk)
        w.add_ssm_time_step_rank(nv)
        w.add_ssm_inner_size(dv * nv)
        w.add_full_attention_interval(_interval(h["layer_types"]))
        w.add_rope_dimension_count(int(h["head_dim"] * rope.get("partial_rotary_factor", 0.25)))

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else None
        if name.endswith(".A_log"):
            return [(f"{blk}.ssm_a", -np.exp(values))]
        if name.endswith(".dt_bias"):
            return [(f"{blk}.ssm_dt.bias", values)]
        if "conv1d" in name:
            return [(f"{blk}.ssm_conv1d.weight", values.squeeze())]
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            import gguf

            names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, c.num_hidden_layers)
            return [(str(names.get_name(name, try_suffixes=(".weight",))), values + 1)]
        if "in_proj_qkvz.weight" in name:
            if legacy:
                return [(f"{blk}.ssm_in.weight", values)]
            split = [dk, dk, nv // nk * dv, nv // nk * dv]
            grouped = values.T.reshape(-1, nk, sum(split))  # ((n_embd, head_count, [q+k+v+z]))
            q, k, v, z = np.split(grouped, np.cumsum(split)[:-1], axis=-1)
            h = values.shape[1]
            qkv = np.concatenate([q.reshape(h, -1), k.reshape(h, -1), v.reshape(h, -1)], axis=-1).T
            return [(f"{blk}.attn_qkv.weight", qkv), (f"{blk}.attn_gate.weight", z.reshape(h, -1).T)]
        if fused and name.endswith("experts.gate_up_proj"):
            return [(f"{blk}.ffn_gate_up_exps.weight", values)]
        return None

    return write_moe(model, folder, out, "qwen3next", keys, transform, metadata=metadata)


def _qwen3next(tmp: Path, layers: int = 4, interval: int = 4, partial: float = 0.25, nk: int = 2, nv: int = 4,
               tied: bool = False) -> tuple[Any, Path]:
    """Qwen3-Next-80B-A3B's form, tiny: three delta-net layers to one gated-attention layer, 2 value heads a key
    head, a quarter of each head rotated, experts with a gated shared expert on every layer, an untied head."""
    import transformers as tf

    config = tf.Qwen3NextConfig(
        **{**TINY, "num_hidden_layers": layers}, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=nk, linear_num_value_heads=nv, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40, norm_topk_prob=True,
        full_attention_interval=interval, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": partial})
    return built(tmp, f"qwen3next_{layers}_{interval}_{partial}_{nk}_{nv}_{tied}", tf.Qwen3NextForCausalLM(config))


CASES = {
    "published_form": (dict(), dict()),
    "legacy_ssm_in": (dict(), dict(legacy=True)),
    "fused_gate_up_exps": (dict(), dict(fused=True)),
    "interval_2_whole_rotary_tied": (dict(interval=2, partial=1.0, tied=True), dict()),
    "one_value_head_a_key_head": (dict(nk=4, nv=4, interval=3, layers=3), dict()),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_qwen3next_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    form, writing = CASES[name]
    hf, folder = _qwen3next(tmp_path, **form)
    assert read_back(hf, write_qwen3next(hf, folder, tmp_path / f"{name}.gguf", **writing)) <= 1e-4


def test_a_qwen3next_gguf_holds_the_checkpoints_weights(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _qwen3next(tmp_path)
    loaded = load(resolve(str(write_qwen3next(hf, folder, tmp_path / "weights.gguf"))))
    ours, theirs = loaded.model.state_dict(), hf.state_dict()
    assert loaded.model.config.layer_types == hf.config.layer_types
    assert loaded.model.config.rope_parameters["partial_rotary_factor"] == 0.25
    assert sorted(ours) == sorted(theirs)
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in theirs) <= 1e-6


@pytest.mark.parametrize("metadata,match", [
    ({"qwen3next.ssm.state_size": 8}, "ssm.inner_size"),
    ({"qwen3next.attention.value_length": 16}, "attention.value_length"),
])
def test_a_qwen3next_file_llmc_cannot_read_faithfully_is_refused(tmp_path: Path, metadata: dict[str, Any],
                                                                 match: str) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _qwen3next(tmp_path)
    path = write_qwen3next(hf, folder, tmp_path / "refused.gguf", metadata=metadata)
    with pytest.raises(UnsupportedModelError, match=match):
        load(resolve(str(path)))
