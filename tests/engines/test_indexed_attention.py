"""Kolibri 1.1's indexed attention layers (ModelSpec.index_layers): keys and values rounded to NVFP4 as transformers
rounds them, each query's keys chosen past the budget (sink + topk + local = 12 in the tiny model) in every lowering
(the parity suite holds all five to transformers' logits over prompts past it), the runtime's paged and prefix-cached
decode past it, an engine's context capped at the model's pool, an int8 cache and 4-bit builds, and the backends
without a key selection refusing it by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Built

from llmc.engines.registry import load_engine_dir
from llmc.errors import InputError, LimitError
from llmc.manifest import load_export
from llmc.runtime.llm import LLM, LLMConfig
from llmc.runtime.request import SamplingParams

ARCH = "kolibri1_1"


@pytest.fixture(scope="module")
def kolibri(tiny_factory: Callable[[str], Built]) -> Built:
    return tiny_factory(ARCH)


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()


def test_the_graphs_nvfp4_is_transformers(tmp_path: Path) -> None:
    """attention.nvfp4 (its E4M3 scale rounded in arithmetic: a float8 Cast needs opset 19) against transformers'
    nvfp4_fake_quantize bit for bit: values across the E4M3 range, blocks whose scale is subnormal or clamped, zeros,
    and E2M1 ties (x / scale at 0.25, 2.5, 5: to even)."""
    import onnx
    import onnxruntime as ort
    import torch
    from onnx import TensorProto, helper
    from transformers.models.kolibri1_1.modeling_kolibri1_1 import nvfp4_fake_quantize

    from llmc.graph.attention import nvfp4
    from llmc.graph.builder import GraphBuilder
    from llmc.graph.layers import Ctx

    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((65, 16)) * 10.0 ** rng.uniform(-4, 3, (65, 1)),  # scales 2^-13 .. 2^8
            np.zeros((1, 16)), np.full((1, 16), 1e4),  # (the clamps: 2^-9, 448)
            np.tile(np.array([6.0, 0.25, 2.5, 5.0, -0.75, 1.5, 3.5, -5.0] * 2), (1, 1)) * 0.01]
    x = np.concatenate(rows).astype(np.float32).reshape(-1, 4, 16)  # [n, 4 blocks of 16 -> 64 wide]
    b = GraphBuilder(17, "float32")
    c = Ctx(b, None, None, None, False)  # type: ignore[arg-type]  # (nvfp4 reads the builder alone)
    b.output("Identity", [nvfp4(c, "x")], "y")
    graph = helper.make_graph(b.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 64])],
                              list(b.constants.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    flat = x.reshape(-1, 64)
    got = ort.InferenceSession(model.SerializeToString()).run(None, {"x": flat})[0]
    want = nvfp4_fake_quantize(torch.from_numpy(flat)).numpy()
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {got.size} differ"


def test_the_cache_is_kept_nvfp4_and_shared(kolibri: Built) -> None:
    """Layer 3 reads layer 1's cache (kv_source_layers): 4 caches for 5 layers; an indexed layer's cached keys and
    values are NVFP4 values (each 16 of a head's dims an E2M1 grid times one scale), a sliding layer's not."""
    m = load_export(kolibri.export_dir).model
    assert m.kv_layers == (0, 1, 2, 4) and m.index_budget == 12
    engine = load_engine_dir(kolibri.engine("gqa"))  # (an fp32 cache of rows: no key tiles)
    kv = engine.new_kv_cache(1, 32)
    engine.prefill([0], [_ids(1, 20)], kv)
    for j, layer in enumerate(m.kv_layers):  # (E2M1 has 8 magnitudes: 0, 0.5, 1, 1.5, 2, 3, 4, 6)
        for buf in (kv.keys[j], kv.values[j]):
            blocks = np.abs(np.asarray(buf)[0, :, :20].reshape(-1, 16))
            magnitudes = [len(np.unique(block)) for block in blocks]
            assert (max(magnitudes) <= 8) is m.indexed(layer), (layer, magnitudes)


def test_the_runtime_decodes_past_the_budget_as_transformers(kolibri: Built,
                                                             hf_factory: Callable[[Built], Any]) -> None:
    """The default engine under the runtime (llmc's operator, paged KV, prefix caching; an fp32 cache: the fp16
    rounding of the sliding layers' caches moves later layers' keys across the NVFP4 grid) decodes prompts past the
    budget to transformers' greedy tokens, a second prompt on the first's prefix too (its blocks reused)."""
    import torch

    hf = hf_factory(kolibri)
    llm = LLM(kolibri.engine("default"), LLMConfig(kv_budget_mb=64))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prefix = _ids(5, 70)  # (a block of 64 and more)
    for prompt in ([*prefix, 5], [*prefix, 6, 7]):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == want[0, len(prompt):].tolist()
    if llm.engine.kv_block_size:  # (paged: llmc's operator, the default where its AVX-512 path runs)
        assert llm.loop.stats().prefix_hit_tokens > 0


def test_the_context_is_the_models_pool(kolibri: Built) -> None:
    """Past index_pool_size keys Kolibri 1.1's indexers choose a pool of key blocks, which llmc does not build: an
    engine holds that many positions (192 here) and a longer request is refused naming it."""
    assert load_export(kolibri.export_dir).model.max_positions == 192
    llm = LLM(kolibri.engine("default"), LLMConfig(kv_budget_mb=64))
    with pytest.raises(LimitError, match="the context holds 192"):
        llm.generate([_ids(2, 193)], SamplingParams(max_tokens=1))
    with pytest.raises(LimitError, match="exceeds the context of 192 tokens"):
        llm.generate([_ids(2, 150)], SamplingParams(max_tokens=50))


def test_an_int8_cache_and_quantized_builds_follow_transformers(kolibri: Built, tmp_path: Path,
                                                                hf_factory: Callable[[Built], Any]) -> None:
    """llmc's int8 cache (keys through the Hadamard matrix: the routing queries meet them through it too) and int8 /
    4-bit products past the budget: correlated with transformers' logits past 0.995 (0.9985 measured), 0.9 (0.937:
    the NVFP4 grid turns the weights' rounding into whole steps of some keys and values; Gemma 4's int8 gives
    0.995+) and 0.5 (4-bit)."""
    import torch

    from llmc.engines.ort.build import BuildConfig, build_ort

    ids = _ids(4, 40)
    with torch.no_grad():
        want = hf_factory(kolibri)(torch.tensor([ids])).logits[0, -1].numpy()
    for name, cfg in (("int8-kv", dict(kv_dtype="int8")), ("int8", dict(quant="int8", quality_target=0.0)),
                      ("int4", dict(quant="int4", quality_target=0.0))):
        build_ort(BuildConfig(kolibri.export_dir, tmp_path / name, attention="llmc", allow_divergence=True,
                              **cfg))  # type: ignore[arg-type]
        engine = load_engine_dir(tmp_path / name)
        got = engine.prefill([0], [ids], engine.new_kv_cache(1, 64))[0]
        assert np.corrcoef(got, want)[0, 1] > {"int8-kv": 0.995, "int8": 0.9, "int4": 0.5}[name], name


def test_backends_without_a_key_selection_refuse_it_by_name(kolibri: Built, tmp_path: Path) -> None:
    from dataclasses import replace

    from llmc.engines.ort.config import BuildConfig
    from llmc.engines.trt.build import TrtBuildConfig, check_trt_config

    export = load_export(kolibri.export_dir)
    unshared = replace(export.model, kv_sources=())  # (its sharing is refused first)
    with pytest.raises(InputError, match=r"indexed attention \(Kolibri 1.1.*past 12 of them\).*--backend ort"):
        check_trt_config(TrtBuildConfig(BuildConfig(kolibri.export_dir, tmp_path / "trt")), unshared)
