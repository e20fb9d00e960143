"""GLM-4.5 GGUF files as llama.cpp's `Glm4MoeModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_glm4moe(model: Any, folder: Path, out: Path, nextn: int = 1, metadata: dict[str, Any] | None = None,
                  sections: list[int] | None = None) -> Path:
    """`TextModel`'s keys with `nextn` NextN layers counted in the blocks (their tensors written after the model's,
    as the checkpoint holds them: a whole layer and the NextN projections / norms), the rotated dims (head size x
    `partial_rotary_factor`, 0.5 where the config has none), the experts' count / width / shared count, the leading
    dense layers, sigmoid gating, the weights' scale and norm, `nextn_predict_layers`; the selection bias as
    `exp_probs_b.bias`, the experts stacked; `sections`: GLM-4.5V's multimodal rotary sections."""
    c = model.config
    rng = np.random.default_rng(0)
    h_, e, i_ = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size

    def keys(w: Any, h: dict[str, Any]) -> None:
        import gguf

        text_keys(w, {**h, "num_hidden_layers": h["num_hidden_layers"] + nextn})
        head = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
        factor = h.get("partial_rotary_factor", (h.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))
        w.add_rope_dimension_count(int(head * factor))
        w.add_expert_count(h["n_routed_experts"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_shared_count(h["n_shared_experts"])
        w.add_leading_dense_block_count(h["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(h["routed_scaling_factor"])
        w.add_expert_weights_norm(h["norm_topk_prob"])
        w.add_nextn_predict_layers(nextn)
        if sections is not None:
            w.add_rope_dimension_sections(sections)
        for n in range(c.num_hidden_layers, c.num_hidden_layers + nextn):  # (the MTP layers: llama.cpp skips them)
            for name, shape in (("attn_norm.weight", (h_,)), ("attn_q.weight", (h_, h_)),
                                ("ffn_gate_inp.weight", (e, h_)), ("exp_probs_b.bias", (e,)),
                                ("ffn_gate_exps.weight", (e, i_, h_)), ("ffn_down_exps.weight", (e, h_, i_)),
                                ("nextn.eh_proj.weight", (h_, 2 * h_)), ("nextn.enorm.weight", (h_,)),
                                ("nextn.hnorm.weight", (h_,)), ("nextn.shared_head_norm.weight", (h_,))):
                w.add_tensor(f"blk.{n}.{name}", rng.standard_normal(shape).astype(np.float32))

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        if name.endswith("e_score_correction_bias"):
            return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", values)]
        return None

    return write_moe(model, folder, out, "glm4moe", keys, transform, metadata=metadata)


def _glm(tmp: Path, **extra: Any) -> tuple[Any, Path]:
    """GLM-4.5-Air's form: q / k / v biases, half of each head rotated, the first layer dense, a shared expert,
    sigmoid routing with a selection bias, renormalized and scaled; `extra` for GLM-4.5's q / k norms."""
    import torch
    import transformers as tf

    config = tf.Glm4MoeConfig(**{**TINY, "num_hidden_layers": 3}, head_dim=24, n_routed_experts=8,
                              num_experts_per_tok=3, moe_intermediate_size=24, n_shared_experts=1,
                              first_k_dense_replace=1, attention_bias=True, norm_topk_prob=True,
                              routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                          "partial_rotary_factor": 0.5}, **extra)
    model = tf.Glm4MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    return built(tmp, "glm4_moe", model)


@pytest.mark.parametrize("extra", [{}, {"use_qk_norm": True, "n_group": 4, "topk_group": 2}])
def test_glm4moe_reads_back_as_its_checkpoint(tmp_path: Path, extra: dict[str, Any]) -> None:
    hf, folder = _glm(tmp_path, **extra)
    path = write_glm4moe(hf, folder, tmp_path / "glm.gguf")
    assert read_back(hf, path) <= 1e-4


def test_glm4moe_without_nextn_layers_reads_back(tmp_path: Path) -> None:
    hf, folder = _glm(tmp_path)
    assert read_back(hf, write_glm4moe(hf, folder, tmp_path / "glm.gguf", nextn=0)) <= 1e-4


def test_glm4moe_nextn_layers_are_left_out(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _glm(tmp_path)
    model = load(resolve(str(write_glm4moe(hf, folder, tmp_path / "glm.gguf")))).model
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    assert model.config.num_mtp_layers == 0


def test_glm4moe_softmax_routing_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _glm(tmp_path)
    path = write_glm4moe(hf, folder, tmp_path / "glm.gguf", metadata={"glm4moe.expert_gating_func": 1})
    with pytest.raises(UnsupportedModelError, match="expert_gating_func"):
        load(resolve(str(path)))


def test_a_glm4v_moe_text_gguf_is_its_text_model(tmp_path: Path) -> None:
    """GLM-4.5V's text half: GLM-4.5 with the multimodal rotary's sections (q / k rows as they are)."""
    hf, folder = _glm(tmp_path)
    assert read_back(hf, write_glm4moe(hf, folder, tmp_path / "glm.gguf", sections=[2, 2, 2, 0])) <= 1e-4
    with pytest.raises(UnsupportedModelError, match="dimension_sections"):
        read_back(hf, write_glm4moe(hf, folder, tmp_path / "bad.gguf", sections=[2, 2, 2, 2]))
