"""Export holds a model's products once (llmc/export/release.py): transformers' copy of each decoder layer's
weights is let go once the graphs' own exist, the model computing the same logits from views of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def _model(kind: str) -> Any:
    torch.manual_seed(0)
    config = {"llama": lambda: tf.LlamaConfig(**COMMON),  # q, k, v joined; gate and up joined
              "phi3": lambda: tf.Phi3Config(**COMMON, pad_token_id=0),  # fused qkv_proj and gate_up_proj
              "qwen2": lambda: tf.Qwen2Config(**COMMON),  # q/k/v biases
              "gemma": lambda: tf.GemmaConfig(**COMMON, head_dim=16),  # 1 + w norms (kept: folded)
              "mixtral": lambda: tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),  # experts
              "opt": lambda: tf.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64),
              "gpt_bigcode": lambda: tf.GPTBigCodeConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                         n_positions=64, multi_query=True),  # blocks named h.i
              }[kind]()
    return tf.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", ["llama", "phi3", "qwen2", "gemma", "mixtral", "opt", "gpt_bigcode"])
def test_each_layer_product_is_held_once_and_computes_the_same(kind: str) -> None:
    from llmc.export.arch import from_transformers

    model = _model(kind)
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        before = model(ids).logits.numpy().copy()
    products = {n for n, p in model.named_parameters() if p.ndim >= 2 and (".layers." in n or ".h." in n)}
    ckpt = from_transformers(model)
    ours = [a for a in ckpt.weights.values() if a.ndim >= 2]
    params = dict(model.named_parameters())
    shared = {n for n in products if any(np.shares_memory(params[n].detach().numpy(), a) for a in ours)}
    assert shared == products  # (every layer's product, and a mixture's experts stacked, is a view of the graphs'
    # copy: transformers' own is gone)
    with torch.no_grad():
        after = model(ids).logits.numpy()
    np.testing.assert_allclose(after, before, rtol=0, atol=1e-5)


def test_a_parameter_held_changed_keeps_its_own_copy() -> None:
    """A product the graphs hold otherwise than as its columns (permuted, scaled) is not matched: its values stay."""
    from llmc.export.release import _held_as_columns

    rng = np.random.default_rng(0)
    theirs = rng.standard_normal((6, 4)).astype(np.float32)  # [out, in]
    joined = np.concatenate([rng.standard_normal((3, 4)), theirs, rng.standard_normal((2, 4))]).T.astype(np.float32)
    block = _held_as_columns(theirs, [joined])
    assert block is not None and np.shares_memory(block, joined) and np.array_equal(block, theirs.T)
    assert _held_as_columns(theirs, [theirs[::-1].T.copy()]) is None  # (rows permuted)
    assert _held_as_columns(theirs, [2 * theirs.T]) is None  # (scaled)
    assert _held_as_columns(theirs, [theirs.T]) is None  # (its own memory: nothing to let go)


@pytest.mark.parametrize(("mode", "kept"), [("offline", 0), ("online", 14)])
def test_a_bitnet_checkpoint_holds_its_products_once_offline_twice_online(tmp_path: Path, mode: str,
                                                                          kept: int) -> None:
    """An offline AutoBitLinear's weights (its scale folded in place) are the graphs' floats: let go, as
    config_check counts them (once); an online one's master weights are rounded into other values: they stay
    (twice)."""
    from tiny_models import _as_published_bitnet, make_model

    from llmc.export import sources
    from llmc.export.arch import from_transformers

    hf_dir = make_model("bitnet", tmp_path / "hf")
    _as_published_bitnet(hf_dir, "autobitlinear", mode)
    model = sources.load(sources.resolve(str(hf_dir), False)).model
    ckpt = from_transformers(model)
    ours = [a for a in ckpt.weights.values() if a.ndim >= 2]
    products = [p for n, p in model.named_parameters() if p.ndim >= 2 and ".layers." in n]
    own = [p for p in products if not any(np.shares_memory(p.detach().numpy(), a) for a in ours)]
    assert len(products) == 14 and len(own) == kept
