"""GPT-NeoX / Pythia GGUF files (llama.cpp's `gptneox`) as `GPTNeoXModel` writes them, read back by llmc
(gguf_archs/dense_old_gptneox) to the logits of the checkpoint they came from: the parallel residual (Pythia's) and
the sequential one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, built, read_back


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
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, width),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_rope_dimension_count, int(c.rope_parameters["partial_rotary_factor"] * (width // heads))),
                       (w.add_head_count, heads), (w.add_parallel_residual, c.use_parallel_residual),
                       (w.add_layer_norm_eps, c.layer_norm_eps), (w.add_file_type, gguf.LlamaFileType.ALL_F32)):
        add(value)
    if kv is not None:
        w.add_head_count_kv(kv)
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPTNEOX, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        values = tensor.detach().float().numpy()
        if name.endswith("attention.query_key_value.weight"):
            qkv = values.reshape(heads, 3, width // heads, width)
            values = np.concatenate([qkv[:, i].reshape(-1, width) for i in range(3)])
        elif name.endswith("attention.query_key_value.bias"):
            qkv = values.reshape(heads, 3, width // heads)
            values = np.concatenate([qkv[:, i].reshape(width) for i in range(3)])
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        w.add_tensor(mapped, np.ascontiguousarray(values))
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
