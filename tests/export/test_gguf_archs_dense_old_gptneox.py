"""GPT-NeoX / Pythia GGUF files (llama.cpp's `gptneox`) as `GPTNeoXModel` writes them, read back by llmc
(gguf_archs/dense_old_gptneox) to the logits of the checkpoint they came from: the parallel residual (Pythia's) and
the sequential one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, add_keys, add_tensors, built, read_back


def write_gptneox(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                  kv: int | None = None) -> Path:
    """As `GPTNeoXModel` writes it: context, width, layers, MLP width, rotated dims (int(share x head size)), heads,
    the parallel residual, LayerNorm epsilon; each layer's fused q / k / v rows and bias regrouped from
    (query, key, value) per head into all queries, all keys, all values. `kv`: a KV head count the converter does
    not write (files llmc must refuse)."""
    import gguf

    c = model.config
    heads, width = c.num_attention_heads, c.hidden_size
    w = gguf.GGUFWriter(str(out), "gptneox")
    add_keys(w, context_length=c.max_position_embeddings, embedding_length=width, block_count=c.num_hidden_layers,
             feed_forward_length=c.intermediate_size,
             rope_dimension_count=int(c.rope_parameters["partial_rotary_factor"] * (width // heads)), head_count=heads,
             parallel_residual=c.use_parallel_residual, layer_norm_eps=c.layer_norm_eps,
             file_type=gguf.LlamaFileType.ALL_F32)
    if kv is not None:
        w.add_head_count_kv(kv)
    _tokenizer(w, folder, c.vocab_size)

    def regroup(name: str, values: np.ndarray) -> np.ndarray:
        if name.endswith("attention.query_key_value.weight"):
            qkv = values.reshape(heads, 3, width // heads, width)
            return np.concatenate([qkv[:, i].reshape(-1, width) for i in range(3)])
        if name.endswith("attention.query_key_value.bias"):
            qkv = values.reshape(heads, 3, width // heads)
            return np.concatenate([qkv[:, i].reshape(width) for i in range(3)])
        return values
    add_tensors(w, model, gguf.MODEL_ARCH.GPTNEOX, regroup)
    _finish(w, (), metadata)
    return out


def _pythia(tmp: Path, parallel: bool = True) -> tuple[Any, Path]:
    """Pythia's form: a quarter of each head rotated, biases everywhere, an untied head; parallel residual or not."""
    import transformers as tf

    common = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    config = tf.GPTNeoXConfig(**{**common, "hidden_size": 128, "intermediate_size": 512},
                              use_parallel_residual=parallel,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.25})
    return built(tmp, f"gptneox-{parallel}", tf.GPTNeoXForCausalLM(config))


@pytest.mark.parametrize("parallel", [True, False])
def test_a_gptneox_gguf_is_the_model_it_came_from(tmp_path: Path, parallel: bool) -> None:
    hf, folder = _pythia(tmp_path, parallel)
    assert read_back(hf, write_gptneox(hf, folder, tmp_path / "gptneox.gguf")) <= 1e-4


def test_a_gptneox_gguf_with_fewer_kv_heads_is_refused(tmp_path: Path) -> None:
    from llmc.errors import UnsupportedModelError
    from llmc.export.sources import load, resolve

    hf, folder = _pythia(tmp_path)
    path = write_gptneox(hf, folder, tmp_path / "gptneox.gguf", kv=2)
    with pytest.raises(UnsupportedModelError, match="head_count_kv 2"):
        load(resolve(str(path)))
