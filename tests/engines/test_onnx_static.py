"""The "onnx-static" lowering (Attention over the whole fixed-size buffer under a [B, 1, S, max_seq] mask: what
TensorRT's native attention is built from) against the in-place "onnx" reference (keys sliced to max(position) + 1):
the same logits to 1e-4 for prompts of several lengths, batched decode steps and prompt chunks, on tiny models (full
attention, sliding windows with soft-caps, q/k norms) and on SmolLM2 (slow)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import Built

from llmc.engines.base import Engine
from llmc.engines.ort.build import BuildConfig, build_ort
from llmc.engines.registry import load_engine_dir

TOL = 1e-4


def _ids(seed: int, n: int, vocab: int = 320) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


PROMPTS = [_ids(1, 1), _ids(2, 7), _ids(3, 23)]


def _trace(engine: Engine, long_prompt: int) -> np.ndarray:
    """Logits of: three prompts batched, three batched decode steps, a 5-token chunk into one row, then one prompt
    of `long_prompt` tokens and two steps after it (a different slot)."""
    kv = engine.new_kv_cache(4, 160)
    out = [engine.prefill([0, 1, 2], PROMPTS, kv)]
    for step in range(3):
        out.append(engine.decode([0, 1, 2], [[10 + step], [20 + step], [30 + step]], kv))
    out.append(engine.decode([1], [[40, 41, 42, 43, 44]], kv))
    out.append(engine.prefill([3], [_ids(4, long_prompt)], kv))
    for step in range(2):
        out.append(engine.decode([3, 0], [[50 + step], [60 + step]], kv))
    return np.concatenate(out)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_whole_buffer_attention_matches_the_inplace_reference(arch: str,
                                                              tiny_factory: Callable[[str], Built]) -> None:
    tiny = tiny_factory(arch)
    ours = _trace(load_engine_dir(tiny.engine("onnx-static")), 100)
    reference = _trace(load_engine_dir(tiny.engine("onnx")), 100)
    assert np.abs(ours - reference).max() <= TOL


def test_the_graph_attends_over_the_buffer_not_a_slice(tiny_llama: Built) -> None:
    model = onnx.load(str(tiny_llama.engine("onnx-static") / "model.onnx"), load_external_data=False)
    producers = {out: n.op_type for n in model.graph.node for out in n.output}
    attn = [n for n in model.graph.node if n.op_type == "Attention"]
    assert attn and all(producers[n.input[1]] == producers[n.input[2]] == "TensorScatter" for n in attn)
    reference = onnx.load(str(tiny_llama.engine("onnx") / "model.onnx"), load_external_data=False)
    ref_producers = {out: n.op_type for n in reference.graph.node for out in n.output}
    assert all(ref_producers[n.input[1]] == "Slice" for n in reference.graph.node if n.op_type == "Attention")


@pytest.mark.slow
def test_smollm2_whole_buffer_attention_matches_the_inplace_reference(smollm2: Built, tmp_path: Path) -> None:
    engines = {}
    for attention in ("onnx", "onnx-static"):
        build_ort(BuildConfig(smollm2.export_dir, tmp_path / attention, attention=attention))
        engines[attention] = load_engine_dir(tmp_path / attention)
    ours, reference = _trace(engines["onnx-static"], 120), _trace(engines["onnx"], 120)
    assert np.abs(ours - reference).max() <= TOL
