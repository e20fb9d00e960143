"""DBRX GGUF files as llama.cpp's `DbrxModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import write_moe


def write_dbrx(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """`DbrxModel`'s own keys (no `TextModel` ones: the layers, context, width, the experts' width as the
    feed-forward length, heads, KV heads, rotary base, q / k / v clamp, experts' count and top-k, LayerNorm
    epsilon 1e-5); the experts' [E x I, H] products viewed as [E, I, H], `w2` permuted to [E, H, I], under
    `.weight` names (gate / up / down stacks)."""
    import gguf

    c = model.config
    e, ff, hidden = c.ffn_config.moe_num_experts, c.ffn_config.ffn_hidden_size, c.d_model

    def keys(w: Any, h: dict[str, Any]) -> None:
        attn, ffn = h["attn_config"], h["ffn_config"]
        w.add_block_count(h["n_layers"])
        w.add_context_length(h["max_seq_len"])
        w.add_embedding_length(h["d_model"])
        w.add_feed_forward_length(ffn["ffn_hidden_size"])
        w.add_head_count(h["n_heads"])
        w.add_head_count_kv(attn["kv_n_heads"])
        w.add_rope_freq_base(attn.get("rope_theta", h["rope_parameters"]["rope_theta"]))
        w.add_clamp_kqv(attn["clip_qkv"])
        w.add_expert_count(ffn["moe_num_experts"])
        w.add_expert_used_count(ffn["moe_top_k"])
        w.add_layer_norm_eps(1e-5)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        kind = name.rsplit(".", 1)[1]
        if ".ffn.experts.mlp." not in name:
            return None
        blk = f"blk.{name.split('.')[2]}"
        stack = values.reshape(e, ff, hidden)
        if kind == "w2":
            return [(f"{blk}.ffn_down_exps.weight", stack.transpose(0, 2, 1))]
        return [(f"{blk}.{'ffn_gate_exps' if kind == 'w1' else 'ffn_up_exps'}.weight", stack)]

    return write_moe(model, folder, out, "dbrx", keys, transform, metadata=metadata)


def _dbrx(tmp: Path) -> tuple[Any, Path]:
    """DBRX's form: grouped-query attention with a clamp on the fused q / k / v (8 in DBRX, 1 here so that the
    tiny model's values pass it), LayerNorms without biases, 16 experts 4 at a time (here 8 and 3), an untied
    head."""
    import transformers as tf

    config = tf.DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=320,
                           attn_config={"kv_n_heads": 2, "clip_qkv": 1.0, "rope_theta": 500000.0},
                           ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 8, "moe_top_k": 3},
                           rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return built(tmp, "dbrx", tf.DbrxForCausalLM(config))


def test_dbrx_reads_back_as_its_checkpoint(tmp_path: Path) -> None:
    hf, folder = _dbrx(tmp_path)
    assert read_back(hf, write_dbrx(hf, folder, tmp_path / "dbrx.gguf")) <= 1e-4


def test_dbrx_clamp_shows(tmp_path: Path) -> None:
    """q / k / v pass the clamp: a file whose clamp is another reads as another model (the key is read)."""
    hf, folder = _dbrx(tmp_path)
    path = write_dbrx(hf, folder, tmp_path / "dbrx.gguf", metadata={"dbrx.attention.clamp_kqv": 1e9})
    assert read_back(hf, path) > 1e-3


def test_dbrx_layer_norm_epsilon_apart_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _dbrx(tmp_path)
    path = write_dbrx(hf, folder, tmp_path / "dbrx.gguf", metadata={"dbrx.attention.layer_norm_epsilon": 1e-6})
    with pytest.raises(UnsupportedModelError, match="layer_norm_epsilon"):
        load(resolve(str(path)))
