"""Laguna GGUF files as llama.cpp's `LagunaModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, add_keys, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe

BIAS = "mlp.gate.e_score_correction_bias"


def write_laguna(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                 leave_out: tuple[str, ...] = (), extra: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys with the rotary's from the full layers' table (the sliding layers' base as
    `rope.freq_base_swa`), the vocabulary size, the heads per layer as an array, the window where there is one, the
    experts' and shared expert's widths, renormalization (always), the routed scale, sigmoid gating (always), the
    leading dense layers, each layer type's rotated dims; the experts stacked, the selection bias as
    `exp_probs_b.bias`, the rest by Step-3.5's name table (gguf's package has none for `laguna`). `extra`: keys the
    converter does not write, added (`add_keys`)."""
    import gguf

    def keys(w: Any, h: dict[str, Any]) -> None:
        rope = h["rope_parameters"]
        full, swa = rope["full_attention"], rope.get("sliding_attention")
        text_keys(w, {**h, "rope_parameters": full})
        if swa is not None:
            w.add_rope_freq_base_swa(swa["rope_theta"])
        w.add_vocab_size(h["vocab_size"])
        w.add_head_count(h["num_attention_heads_per_layer"] or [h["num_attention_heads"]] * h["num_hidden_layers"])
        if h.get("sliding_window"):
            w.add_sliding_window(h["sliding_window"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(h["shared_expert_intermediate_size"])
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(float(h["moe_routed_scaling_factor"]))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        types = h["mlp_layer_types"]
        w.add_leading_dense_block_count(types.index("sparse") if "sparse" in types else len(types))
        w.add_rope_dimension_count(int(h["head_dim"] * float(full.get("partial_rotary_factor", 1.0))))
        if swa is not None:
            w.add_rope_dimension_count_swa(int(h["head_dim"] * float(swa.get("partial_rotary_factor", 1.0))))
        add_keys(w, **(extra or {}))

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", values)] if name.endswith(BIAS) else None

    return write_moe(model, folder, out, "laguna", keys, transform, metadata=metadata, leave_out=leave_out,
                     table="step35")


YARN = {"rope_type": "yarn", "rope_theta": 5e5, "partial_rotary_factor": 0.5, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
        "attention_factor": 0.1 * math.log(4.0) + 1.0}
FULL = {"default": {"rope_type": "default", "rope_theta": 5e4},
        "linear": {"rope_type": "linear", "rope_theta": 5e4, "factor": 2.0, "partial_rotary_factor": 0.75},
        "yarn": YARN}


def _laguna(tmp: Path, form: str = "xs", full: str = "yarn", period: int = 4) -> tuple[Any, Path]:
    """Laguna-XS.2's form at a tiny size ("xs"): a window on every layer but each period's first, more heads on the
    sliding layers, a gate per head, the full layers' rotary (yarn on half of each head) apart from the sliding
    layers' (all of each head at another base), one dense layer, the routed experts' output scaled; or Laguna-M.1's
    ("m"): no window, one head count, a gate per element, two dense layers, no scale."""
    from transformers import AutoConfig, AutoModelForCausalLM

    n = 5
    sliding = [form == "xs" and i % period != 0 for i in range(n)]
    config = AutoConfig.for_model(
        "laguna", **{**TINY, "num_hidden_layers": n, "intermediate_size": 40}, head_dim=16,
        num_attention_heads_per_layer=[6 if s else 4 for s in sliding], num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=32,
        sliding_window=8 if form == "xs" else 0, gating=True if form == "xs" else "per-element",
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        mlp_layer_types=["dense"] * (1 if form == "xs" else 2) + ["sparse"] * (n - (1 if form == "xs" else 2)),
        moe_routed_scaling_factor=2.5 if form == "xs" else 1.0,
        rope_parameters={"full_attention": FULL[full],
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}})
    return built(tmp, f"laguna_{form}_{full}_{period}", AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize(("form", "full"), [("xs", "yarn"), ("xs", "linear"), ("m", "default")])
def test_laguna_reads_back_as_its_checkpoint(tmp_path: Path, form: str, full: str) -> None:
    """XS.2's hybrid form (yarn or linear on the full layers) and M.1's full one (whose sliding rotary table the
    converter writes, which llama.cpp leaves unread without a window)."""
    hf, folder = _laguna(tmp_path, form, full)
    assert read_back(hf, write_laguna(hf, folder, tmp_path / "l.gguf")) <= 1e-4


def test_laguna_slides_by_the_file_s_period(tmp_path: Path) -> None:
    """A scalar `attention.sliding_window_pattern` (the converter writes none) is the period llama.cpp slides by."""
    hf, folder = _laguna(tmp_path, period=2)
    assert read_back(hf, write_laguna(hf, folder, tmp_path / "l.gguf", extra={"sliding_window_pattern": 2})) <= 1e-4


@pytest.mark.parametrize(("form", "metadata", "leave_out", "extra", "match"), [
    ("xs", {"laguna.expert_gating_func": 1}, (), None, "expert_gating_func"),
    ("xs", {"laguna.expert_weights_norm": False}, (), None, "expert_weights_norm"),
    ("xs", None, (), {"expert_group_count": 2}, "expert_group_count"),
    ("xs", None, (), {"head_count_kv": [2, 2, 1, 2, 2]}, "head_count_kv"),
    ("xs", None, (), {"sliding_window_pattern": [True] * 5}, "sliding_window_pattern"),
    ("m", None, ("blk.1.attn_gate.weight",), None, "attn_gate"),
    ("xs", {"laguna.rope.scaling.yarn_beta_fast": 16.0}, (), None, "yarn_beta_fast"),
    ("xs", {"laguna.rope.scaling.yarn_beta_slow": 2.0}, (), None, "yarn_beta_slow"),
    ("xs", {"laguna.rope.scaling.yarn_attn_factor": 1.0}, (), None, "yarn_attn_factor"),
    ("xs", None, (), {"rope_scaling_attn_factors": 2.0}, "rope.scaling.attn_factor"),
    ("xs", {"laguna.rope.dimension_count": 7}, (), None, "rope.dimension_count"),
    ("xs", {"laguna.rope.dimension_count_swa": 18}, (), None, "rope.dimension_count_swa")])
def test_laguna_variants_llmc_cannot_express_are_refused(tmp_path: Path, form: str, metadata: dict[str, Any] | None,
                                                         leave_out: tuple[str, ...], extra: dict[str, Any] | None,
                                                         match: str) -> None:
    hf, folder = _laguna(tmp_path, form)
    path = write_laguna(hf, folder, tmp_path / "l.gguf", metadata=metadata, leave_out=leave_out, extra=extra)
    with pytest.raises(UnsupportedModelError, match=match):
        read_back(hf, path)
