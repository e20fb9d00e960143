"""JetBrains Mellum GGUF files as llama.cpp's `MellumModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from gguf_files import TINY, add_keys, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe

SLIDING, FULL = "sliding_attention", "full_attention"
MELLUM2 = [SLIDING, SLIDING, SLIDING, FULL]  # (Mellum2's layers: each 4th full)


def write_mellum(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                 leave_out: tuple[str, ...] = (), period: int | None = None,
                 extra: dict[str, Any] | None = None) -> Path:
    """`TextModel`'s keys from the full layers' rotary parameters (base, scaling; yarn's attention factor as
    `yarn_attn_factor`), the sliding layers' base as `rope.freq_base_swa`, the experts' width, the window and the
    layer types as booleans (neither without a window); the tensors by Qwen3-MoE's name table (gguf's package has
    none for `mellum`), the experts stacked. `period`: the pattern as that scalar instead (as a fork's converter
    writes a checkpoint without layer types); `extra`: keys the converter does not write (`add_keys`)."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        rope = h["rope_parameters"]
        text_keys(w, {**h, "rope_parameters": rope.get(FULL, rope)})
        if (local := rope.get(SLIDING, {}).get("rope_theta")) is not None:
            w.add_rope_freq_base_swa(local)
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        if h.get("use_sliding_window") in (True, None) and h.get("sliding_window") is not None:
            w.add_sliding_window(h["sliding_window"])
            w.add_sliding_window_pattern([t == SLIDING for t in h["layer_types"]] if period is None else period)
        add_keys(w, **(extra or {}))

    return write_moe(model, folder, out, "mellum", keys, metadata=metadata, leave_out=leave_out, table="qwen3moe")


def _mellum(tmp: Path, types: list[str] | None = None, window: int | None = 8, yarn: bool = True,
            tied: bool = False, head: int = 24) -> tuple[Any, Path]:
    """Mellum2's form at a tiny size: heads of `head` (wider than width / heads), per-head q / k norms, every layer
    routed top-2 of 8 (renormalized), sliding layers at the full layers' base, the full layers' rotary yarn-scaled at
    its own magnitude (Mellum2's attention factor)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    types = types or MELLUM2
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": 5e4}
    if yarn:
        full.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                    attention_factor=0.1 * math.log(4.0) + 1.0)
    config = AutoConfig.for_model(
        "mellum", **{**TINY, "num_hidden_layers": len(types)}, head_dim=head, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, sliding_window=window, layer_types=types, rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_parameters={FULL: full, SLIDING: {"rope_type": "default", "rope_theta": 5e4}})
    return built(tmp, f"mellum_{window}_{yarn}_{tied}_{head}", AutoModelForCausalLM.from_config(config))


def test_mellum_reads_back_as_its_checkpoint(tmp_path: Path) -> None:
    hf, folder = _mellum(tmp_path)
    assert read_back(hf, write_mellum(hf, folder, tmp_path / "mellum.gguf")) <= 1e-4


def test_mellum_without_a_window_or_a_scaling_reads_back(tmp_path: Path) -> None:
    """A checkpoint without a window has neither window nor pattern in the file (every layer full), one without
    scaling no `rope.scaling.*` keys, a tied one no `output.weight`; a file without the head size has heads of
    width / heads (llama.cpp's default)."""
    hf, folder = _mellum(tmp_path, [FULL] * 3, window=None, yarn=False, tied=True, head=16)
    path = write_mellum(hf, folder, tmp_path / "mellum.gguf",
                        leave_out=("mellum.attention.key_length", "mellum.attention.value_length"))
    assert read_back(hf, path) <= 1e-4


def test_mellum_with_a_period_reads_back(tmp_path: Path) -> None:
    """A scalar pattern is llama.cpp's period: each 4th layer full, as Mellum2's layer types."""
    hf, folder = _mellum(tmp_path)
    assert read_back(hf, write_mellum(hf, folder, tmp_path / "mellum.gguf", period=4)) <= 1e-4


def test_mellum_without_a_pattern_attends_fully_everywhere(tmp_path: Path) -> None:
    """llama.cpp's Mellum takes its period of 4 from a scalar key only: a window without the pattern key slides no
    layer."""
    from llmc.export.gguf_read import config_for

    hf, folder = _mellum(tmp_path)
    path = write_mellum(hf, folder, tmp_path / "mellum.gguf", leave_out=("mellum.attention.sliding_window_pattern",))
    assert config_for(path).layer_types == [FULL] * 4


@pytest.mark.parametrize(("metadata", "leave_out", "extra", "match"), [
    ({"mellum.rope.freq_base_swa": 1e4}, (), {}, "rope.freq_base_swa"),
    ({"mellum.rope.scaling.yarn_attn_factor": 1.5}, (), {}, "yarn_attn_factor"),
    ({"mellum.rope.scaling.yarn_beta_fast": 16.0}, (), {}, "yarn_beta_fast"),
    ({"mellum.rope.scaling.type": "longrope"}, (), {}, "rope.scaling.type"),
    ({}, (), {"rope_scaling_attn_factors": 2.0}, "rope.scaling.attn_factor"),
    ({}, (), {"rope_dimension_count": 12}, "rope.dimension_count"),
    ({"mellum.attention.value_length": 16}, (), {}, "attention.value_length"),
    ({}, ("blk.1.ffn_gate_inp.weight",), {}, "blk.1.ffn_gate_inp")])
def test_mellum_variants_llmc_cannot_express_are_refused(tmp_path: Path, metadata: dict[str, Any],
                                                         leave_out: tuple[str, ...], extra: dict[str, Any],
                                                         match: str) -> None:
    hf, folder = _mellum(tmp_path)
    path = write_mellum(hf, folder, tmp_path / "mellum.gguf", metadata=metadata, leave_out=leave_out, extra=extra)
    with pytest.raises(UnsupportedModelError, match=match):
        read_back(hf, path)
