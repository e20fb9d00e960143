"""GGUF files of the architectures llmc reads itself (llmc/export/gguf_archs), written as llama.cpp's converter writes
them (`write_gemma`, ...), read back to the logits of the checkpoint they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, built, read_back


def write_gemma(model: Any, folder: Path, out: Path) -> Path:
    """As `GemmaModel` writes it: context, width, layers, MLP width, heads, KV heads, RMS epsilon, head size (no
    rotary base); norms as 1 + w; no lm_head."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(out), "gemma")
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_key_length, c.head_dim),
                       (w.add_value_length, c.head_dim)):
        add(value)
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        values = tensor.detach().float().numpy() + (1 if name.endswith("norm.weight") else 0)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(values))
    _finish(w, (), None)
    return out


def _gemma(tmp: Path) -> tuple[Any, Path]:
    import transformers as tf

    return built(tmp, "gemma", tf.GemmaForCausalLM(tf.GemmaConfig(**{**TINY, "num_key_value_heads": 1},
                                                                    head_dim=32)))


CASES = {"gemma": (_gemma, write_gemma)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_gguf_llmc_reads_itself_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    make, write = CASES[name]
    hf, folder = make(tmp_path)
    assert read_back(hf, write(hf, folder, tmp_path / f"{name}.gguf")) <= 1e-4


def test_a_gguf_llmc_reads_itself_exports(tmp_path: Path) -> None:
    """The whole route: a Gemma 1 file to an export (golden outputs and parity against the model llmc read) and its
    engine, which computes the logits of the checkpoint the file came from."""
    import torch

    from llmc.engines.ort.build import export_engine
    from llmc.export.exporter import ExportConfig, export

    hf, folder = _gemma(tmp_path)
    manifest = export(ExportConfig(str(write_gemma(hf, folder, tmp_path / "g.gguf")), tmp_path / "export"))
    engine = export_engine(manifest, tmp_path / "export")
    ids = np.random.default_rng(1).integers(3, 320, 40).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
    assert float(np.abs(engine.prefill([0], [ids], engine.new_kv_cache(1, 128))[0] - ref).max()) <= 1e-4
