"""Llama 4 (text) GGUF files as llama.cpp's `Llama4Model` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _llama3_divisors, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_llama4(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                 leave_out: tuple[str, ...] = (), more: Callable[[Any], None] | None = None) -> Path:
    """`TextModel`'s keys with `intermediate_size` the dense layers' width (the converter swaps
    `intermediate_size_mlp` back into it), `LlamaModel`'s vocabulary size and rotated dims (the head size), the
    mixture step and the experts' width; a llama3 rotary as `rope_freqs` divisors; the experts split from
    `gate_up_proj` [E, H, 2I] and transposed to [E, I, H] (down [E, H, I]); q / k as they are (`undo_permute`
    off). `more(writer)` adds keys the converter does not write."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, {**h, "intermediate_size": h["intermediate_size_mlp"]})
        w.add_vocab_size(h["vocab_size"])
        w.add_rope_dimension_count(h["head_dim"])
        w.add_interleave_moe_layer_step(h["interleave_moe_layer_step"])
        w.add_expert_feed_forward_length(h["intermediate_size"])
        rope = h["rope_parameters"]
        if rope.get("rope_type") == "llama3":
            w.add_tensor("rope_freqs.weight", _llama3_divisors(rope, h["head_dim"]))
        if more is not None:
            more(w)

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        blk = f"blk.{name.split('.')[2]}" if name.startswith("model.layers.") else ""
        if name.endswith("experts.gate_up_proj"):
            gate, up = np.split(values.transpose(0, 2, 1), 2, axis=1)
            return [(f"{blk}.ffn_gate_exps.weight", gate), (f"{blk}.ffn_up_exps.weight", up)]
        if name.endswith("experts.down_proj"):
            return [(f"{blk}.ffn_down_exps.weight", values.transpose(0, 2, 1))]
        return None

    return write_moe(model, folder, out, "llama4", keys, transform, metadata=metadata, leave_out=leave_out)


def _llama4(tmp: Path, experts: int = 4, step: int = 2, tied: bool = False, scaled: bool = True) -> tuple[Any, Path]:
    """Llama 4's form at a tiny size: 5 layers (3 chunked and rotated, a 4th full and unrotated, a 5th rotated), a
    mixture every `step` layers with a shared expert and top-1 sigmoid routing on the experts' inputs, dense layers
    of another width, q / k norms unless the experts are Maverick's 128, a llama3 rotary scaling (Scout's)."""
    import transformers as tf

    rope = ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 64} if scaled else
            {"rope_type": "default", "rope_theta": 500000.0})
    config = tf.Llama4TextConfig(**{**TINY, "num_hidden_layers": 5, "intermediate_size": 24}, head_dim=16,
                                 intermediate_size_mlp=80, num_local_experts=experts, num_experts_per_tok=1,
                                 interleave_moe_layer_step=step, use_qk_norm=experts != 128,
                                 tie_word_embeddings=tied, rope_parameters=rope)
    return built(tmp, f"llama4_{experts}_{step}_{tied}_{scaled}", tf.Llama4ForCausalLM(config))


@pytest.mark.parametrize(("experts", "step", "tied", "scaled"), [(4, 2, False, True), (128, 2, True, False),
                                                                 (4, 1, False, True)])
def test_llama4_reads_back_as_its_checkpoint(tmp_path: Path, experts: int, step: int, tied: bool,
                                             scaled: bool) -> None:
    hf, folder = _llama4(tmp_path, experts, step, tied, scaled)
    assert hf.config.no_rope_layers == [1, 1, 1, 0, 1]
    assert read_back(hf, write_llama4(hf, folder, tmp_path / "llama4.gguf")) <= 1e-4


def test_llama4_config_takes_what_llama_cpp_fixes(tmp_path: Path) -> None:
    """The chunk, temperature and q / k norms llama.cpp fixes (no key holds them) are the config's, whatever the
    checkpoint had; the dense and expert widths come back unswapped."""
    from llmc.export.gguf_read import config_for

    hf, folder = _llama4(tmp_path, experts=128)
    config = config_for(write_llama4(hf, folder, tmp_path / "llama4.gguf"))
    assert (config.model_type, config.attention_chunk_size, config.floor_scale, config.attn_scale) == (
        "llama4_text", 8192, 8192, 0.1)
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention", "chunked_attention"]
    assert (config.use_qk_norm, config.intermediate_size, config.intermediate_size_mlp, config.moe_layers) == (
        False, 24, 80, [1, 3])


@pytest.mark.parametrize(("metadata", "more", "match"), [
    ({}, lambda w: w.add_sliding_window(0), "sliding_window"),
    ({}, lambda w: w.add_sliding_window_pattern(2), "sliding_window_pattern"),
    ({}, lambda w: w.add_attention_scale(0.5), "attention.scale"),
    ({"llama4.rope.dimension_count": 8}, None, "rope.dimension_count"),
    ({"llama4.interleave_moe_layer_step": 0}, None, "interleave_moe_layer_step")])
def test_llama4_variants_llmc_cannot_express_are_refused(tmp_path: Path, metadata: dict[str, Any],
                                                         more: Callable[[Any], None] | None, match: str) -> None:
    hf, folder = _llama4(tmp_path)
    path = write_llama4(hf, folder, tmp_path / "llama4.gguf", metadata=metadata, more=more)
    with pytest.raises(UnsupportedModelError, match=match):
        read_back(hf, path)
