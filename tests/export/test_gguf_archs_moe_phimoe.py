"""Phi-3.5-MoE GGUF files as llama.cpp's `PhiMoeModel` writes them, read back to the logits of the checkpoint."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf_files import TINY, _finish, _tokenizer, add_keys, add_tensors, built, read_back


def write_phimoe(model: Any, folder: Path, out: Path) -> Path:
    """`Phi3MiniModel`'s keys (its own, not `TextModel`'s: the original context, the rotated dims, the window as 0
    for none), the experts' count and top-k; longrope's factors as tensors and its attention factor
    sqrt(1 + ln(scale) / ln(original)); the tensors under gguf's names as they are, the experts stacked."""
    import gguf

    from .test_gguf_archs_moe_common import split_experts

    c = model.config
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(out), "phimoe")
    w.add_name("tiny-phimoe")
    orig = rope["original_max_position_embeddings"]
    rotated = int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads
    add_keys(w, context_length=c.max_position_embeddings, rope_scaling_orig_ctx_len=orig,
             embedding_length=c.hidden_size, feed_forward_length=c.intermediate_size, block_count=c.num_hidden_layers,
             head_count=c.num_attention_heads, head_count_kv=c.num_key_value_heads, layer_norm_rms_eps=c.rms_norm_eps,
             rope_dimension_count=rotated, rope_freq_base=rope["rope_theta"], file_type=gguf.LlamaFileType.ALL_F32,
             sliding_window=c.sliding_window or 0, expert_used_count=c.num_experts_per_tok,
             expert_count=c.num_local_experts)
    _tokenizer(w, folder, c.vocab_size)
    if rope.get("long_factor"):
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    assert not c.tie_word_embeddings  # (the converter writes the head)
    add_tensors(w, model, gguf.MODEL_ARCH.PHIMOE, lambda name, values: (
        list(split_experts(name, values)) if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else values))
    _finish(w, (), None)
    return out


def test_phimoe_reads_back_as_its_checkpoint(tmp_path: Path) -> None:
    """Phi-3.5-MoE's form: biases on q / k / v / o and on the head, LayerNorms with biases, longrope (its mscale the
    one the converter writes, which is what the file holds), a window as long as the context."""
    import transformers as tf

    head = TINY["hidden_size"] // TINY["num_attention_heads"]
    orig = 64
    mscale = math.sqrt(1 + math.log(TINY["max_position_embeddings"] / orig) / math.log(orig))
    rng = np.random.default_rng(0)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": orig,
            "long_factor": (1 + rng.random(head // 2) * 3).tolist(), "short_factor": (1 + rng.random(head // 2)).tolist(),
            "long_mscale": mscale, "short_mscale": mscale}
    config = tf.PhimoeConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                             sliding_window=TINY["max_position_embeddings"], rope_parameters=rope)
    hf, folder = built(tmp_path, "phimoe", tf.PhimoeForCausalLM(config))
    assert read_back(hf, write_phimoe(hf, folder, tmp_path / "phimoe.gguf")) <= 1e-4
