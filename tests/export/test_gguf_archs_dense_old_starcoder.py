"""StarCoder / SantaCoder GGUF files (llama.cpp's `starcoder`) as `StarCoderModel` writes them, read back by llmc
(gguf_archs/dense_old_starcoder) to the logits of the checkpoint they came from: the tied head (the checkpoints')
and an untied one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import _finish, _tokenizer, add_keys, add_tensors, built, read_back


def write_starcoder(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None) -> Path:
    """As `StarCoderModel` writes it: context (n_positions), width, 4 x the width as the MLP's, layers, heads, one KV
    head, LayerNorm epsilon; every tensor as it is, by gguf's name table (the head left out where tied)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(out), "starcoder")
    add_keys(w, context_length=c.n_positions, embedding_length=c.n_embd, feed_forward_length=4 * c.n_embd,
             block_count=c.n_layer, head_count=c.n_head, head_count_kv=1, layer_norm_eps=c.layer_norm_epsilon,
             file_type=gguf.LlamaFileType.ALL_F32)
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, gguf.MODEL_ARCH.STARCODER, blocks=c.n_layer)
    _finish(w, (), metadata)
    return out


def _starcoder(tmp: Path, tied: bool = True) -> tuple[Any, Path]:
    """StarCoder's form: multi-query, learned positions, 4 x the width as the MLP's, biases everywhere, tied."""
    import transformers as tf

    config = tf.GPTBigCodeConfig(vocab_size=320, n_positions=256, n_embd=64, n_layer=2, n_head=4, n_inner=256,
                                 multi_query=True, activation_function="gelu_pytorch_tanh", tie_word_embeddings=tied,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return built(tmp, f"starcoder-{tied}", tf.GPTBigCodeForCausalLM(config))


@pytest.mark.parametrize("tied", [True, False])
def test_a_starcoder_gguf_is_the_model_it_came_from(tmp_path: Path, tied: bool) -> None:
    hf, folder = _starcoder(tmp_path, tied)
    assert read_back(hf, write_starcoder(hf, folder, tmp_path / "starcoder.gguf")) <= 1e-4


def test_a_starcoder_gguf_of_more_kv_heads_is_refused(tmp_path: Path) -> None:
    from llmc.errors import UnsupportedModelError
    from llmc.export.sources import load, resolve

    hf, folder = _starcoder(tmp_path)
    path = write_starcoder(hf, folder, tmp_path / "starcoder.gguf", metadata={"starcoder.attention.head_count_kv": 4})
    with pytest.raises(UnsupportedModelError, match="head_count_kv 4"):
        load(resolve(str(path)))
