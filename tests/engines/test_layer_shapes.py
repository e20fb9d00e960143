"""Layers of different attention shapes, and layers reading another layer's cache (Gemma 4): each KV layer's cache is
its own shape in every KV layout (slots, paged pools, the int8 cache), a KV-shared layer has none and reads its
source's, the default engine and the runtime (paged KV, prefix caching) follow transformers, a quantized build runs,
and the backends that bind one KV shape for every layer refuse such a model by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Built

from llmc.engines.registry import load_engine_dir
from llmc.errors import InputError
from llmc.manifest import load_engine, load_export
from llmc.runtime.llm import LLM, LLMConfig
from llmc.runtime.request import SamplingParams

GEMMA4 = ("gemma4_text", "gemma4_e", "gemma4_moe")


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()


def _hf_logits(hf: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()  # type: ignore[no-any-return]


def _hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=GEMMA4)
def gemma4(request: pytest.FixtureRequest, tiny_factory: Callable[[str], Built]) -> Built:
    return tiny_factory(request.param)


def test_each_kv_layer_keeps_its_own_shape(gemma4: Built) -> None:
    """The manifest records each layer's head size and KV heads; each KV buffer (slots and paged pools) is its
    layer's shape, and the bytes a position takes are their sum, not num_layers times one layer's."""
    m = load_export(gemma4.export_dir).model
    engine = load_engine_dir(gemma4.engine("default"))
    kv = engine.manifest.kv
    assert m.layer_head_dims and set(m.layer_head_dims) == {16, 32}
    assert [kv.dims(j) for j in range(kv.num_layers)] == [(m.kv_heads_of(i), m.head_dim_of(i)) for i in m.kv_layers]
    slots = engine.new_kv_cache(2, 64)
    assert [k.shape for k in slots.keys] == [kv.buffer_shape(j, 2, 64) for j in range(kv.num_layers)]
    if engine.kv_block_size:
        pool = engine.new_paged_kv_cache(2, 64, 8)
        assert [v.shape for v in pool.values] == [kv.buffer_shape(j, 8, engine.kv_block_size)
                                                 for j in range(kv.num_layers)]
    row = {"float16": 2, "float32": 4}[kv.dtype]
    assert engine.kv_bytes_per_token() == 2 * row * sum(h * d for h, d in (kv.dims(j) for j in range(kv.num_layers)))


def test_kv_shared_layers_have_no_cache_and_read_their_source_s(tiny_factory: Callable[[str], Built]) -> None:
    """Gemma 4 E2B / E4B's last layers read the cache of the last layer of their kind before them: 4 caches for 6
    layers, layer 4 (sliding) on layer 2's, layer 5 (full) on layer 3's; their qkv products are q alone, and their
    MLPs twice as wide."""
    tiny = tiny_factory("gemma4_e")
    m = load_export(tiny.export_dir).model
    assert m.kv_sources == (0, 1, 2, 3, 2, 3) and m.kv_layers == (0, 1, 2, 3)
    assert load_engine(tiny.engine("default")).kv.num_layers == 4
    assert m.layer_intermediate_sizes == (96, 96, 96, 96, 192, 192) and m.per_layer_input_size == 8
    from llmc.engines.ort.graphs import load_checkpoint

    weights = load_checkpoint(tiny.export_dir, load_export(tiny.export_dir)).weights
    assert weights["layers.4.qkv.weight"].shape == (64, 4 * 16)  # q alone: 4 heads of 16
    assert weights["layers.3.qkv.weight"].shape == (64, (4 + 2 * 2) * 32)
    assert "layers.4.k_norm.weight" not in weights and "layers.5.v_norm.weight" not in weights


def test_a_layer_whose_values_are_its_keys_takes_the_product_once(tiny_factory: Callable[[str], Built]) -> None:
    """Gemma 4 31B / 26B-A4B's full layers (attention_k_eq_v): their qkv product holds q and k alone (v is k again,
    before the norms), so the keys' weights are stored and read once; the parity suite holds their logits."""
    from llmc.engines.ort.graphs import load_checkpoint

    tiny = tiny_factory("gemma4_text")
    m = load_export(tiny.export_dir).model
    assert m.k_eq_v_layers == (False, True, False, True)
    weights = load_checkpoint(tiny.export_dir, load_export(tiny.export_dir)).weights
    assert weights["layers.1.qkv.weight"].shape == (64, (4 + 1) * 32)  # 4 query heads and 1 KV head of 32
    assert weights["layers.0.qkv.weight"].shape == (64, (4 + 2 * 2) * 16)


@pytest.mark.parametrize("layout", ["default", "llmc"])
def test_kv_shared_layers_read_in_place_on_each_row_s_last_token(tiny_factory: Callable[[str], Built],
                                                                 layout: str) -> None:
    """On llmc's operator the two KV-shared layers read their sources' caches where they are (kv_shared, no
    present outputs) and run on each row's last token alone (no new_tokens input in these paged engines: one new
    token a row), which the decode tests below hold to transformers' logits."""
    import onnx

    graph = onnx.load(str(tiny_factory("gemma4_e").engine(layout) / "model.onnx"), load_external_data=False).graph
    shared = [n for n in graph.node if any(a.name == "kv_shared" and a.i == 1 for a in n.attribute)]
    assert len(shared) == 2 and all(len(n.output) == 1 for n in shared)
    assert any(i.name == "block_table" for i in graph.input)  # (paged: every other attention node reads new_tokens)
    assert all(n.input[8] == "" for n in shared)


@pytest.mark.parametrize("layout", ["default", "llmc", "gqa"])
def test_decode_follows_transformers_after_a_prompt(gemma4: Built, layout: str,
                                                    hf_factory: Callable[[Built], Any]) -> None:
    """Rows of different lengths decode together (two waiting on a third), each to transformers' logits: the fp32
    caches to 1e-4, the default engine's fp16 cache to 1 % of the logits' size (the tiny random models' 4x weights
    carry its rounding further than a trained model's: 0.1-0.4 % measured; a wrong row or layer is ~100 %)."""
    engine = load_engine_dir(gemma4.engine(layout))
    hf = hf_factory(gemma4)
    kv = engine.new_kv_cache(3, 64)
    prompts = [_ids(1, 5), _ids(2, 11), _ids(3, 3)]
    engine.prefill([0, 1, 2], prompts, kv)
    for t in range(3):
        engine.decode([0, 2], [[10 + t], [20 + t]], kv)
    got = [engine.decode([1], [[tok]], kv)[0] for tok in (7, 8, 9)]
    want = _hf_logits(hf, [*prompts[1], 7, 8, 9])[len(prompts[1]):]
    tol = 1e-2 * float(np.abs(want).max()) if layout == "default" else 1e-4
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= tol


def test_the_runtime_generates_transformers_tokens_and_reuses_prefixes(gemma4: Built,
                                                                       hf_factory: Callable[[Built], Any]) -> None:
    """The default engine under the runtime (paged KV, prefix caching): greedy tokens as transformers', and a
    second prompt on the first's prefix reads its KV blocks (no states: a reused prefix is exact) and still gives
    transformers' tokens."""
    hf = hf_factory(gemma4)
    llm = LLM(gemma4.engine("default"), LLMConfig(kv_budget_mb=64))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prefix = _ids(7, 140)  # (two blocks of 64)
    first, second = [*prefix, 5], [*prefix, 6, 7]
    for prompt in (first, second):
        out = llm.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 8)
    stats = llm.loop.stats()
    assert stats.prefix_hit_tokens > 0


def test_an_int8_cache_and_quantized_builds_run(gemma4: Built, tmp_path: Path,
                                               hf_factory: Callable[[Built], Any]) -> None:
    """llmc's int8 cache (each layer's rows of its own width with their scales) and int8 / 4-bit products (each
    layer's own widths) follow transformers' logits: correlated with them past 0.998 (the int8 cache), 0.99 (int8
    weights; 0.995-0.9995 measured) and 0.5 (4-bit weights: 0.68-0.97 on these tiny random models, whose 4x weights
    carry the rounding far); a cache row read at another layer's width, or a lost layer, is not."""
    from llmc.engines.ort.build import BuildConfig, build_ort

    hf = hf_factory(gemma4)
    ids = _ids(4, 20)
    want = _hf_logits(hf, ids)[-1]
    for name, cfg in (("int8-kv", dict(kv_dtype="int8")), ("int8", dict(quant="int8", quality_target=0.0)),
                      ("int4", dict(quant="int4", quality_target=0.0))):
        build_ort(BuildConfig(gemma4.export_dir, tmp_path / name, attention="llmc", allow_divergence=True,
                              **cfg))  # type: ignore[arg-type]
        engine = load_engine_dir(tmp_path / name)
        got = engine.prefill([0], [ids], engine.new_kv_cache(1, 32))[0]
        assert np.isfinite(got).all(), name
        assert np.corrcoef(got, want)[0, 1] > {"int8-kv": 0.998, "int8": 0.99, "int4": 0.5}[name], name
        if gemma4.name == "gemma4_e" and name == "int4":  # (the per-layer embeddings' products of whole blocks too;
            # ple_out's input, 8 wide here, stays fp32)
            import onnx

            stored = {i.name for i in onnx.load(str(tmp_path / name / "model.onnx"),
                                                load_external_data=False).graph.initializer}
            assert any(n.startswith("ple_proj.weight.") for n in stored) and "ple_proj.weight" not in stored
            assert "layers.0.ple_out.weight" in stored


def test_one_kv_shape_backends_refuse_it_by_name(gemma4: Built, tmp_path: Path) -> None:
    """TensorRT's engines and --backend ort-cuda bind one KV shape for every layer: refused naming why (before any
    TensorRT or GPU is needed)."""
    from llmc.engines.ort.config import BuildConfig
    from llmc.engines.ort.cuda import write_cuda_engine
    from llmc.engines.trt.build import TrtBuildConfig, check_trt_config

    export = load_export(gemma4.export_dir)
    with pytest.raises(InputError, match="Gemma 4.*--backend ort"):
        check_trt_config(TrtBuildConfig(BuildConfig(gemma4.export_dir, tmp_path / "trt")), export.model)
    with pytest.raises(InputError, match="--backend ort-cuda binds one KV shape"):
        write_cuda_engine(tmp_path / "cuda", gemma4.export_dir, export, "1.23.0")


def test_a_bf16_per_layer_table_is_stored_in_bf16_alone(tmp_path: Path) -> None:
    """The per-layer embeddings' table is only looked up: where bf16 holds it exactly (a bf16 checkpoint's), the
    engine stores that form alone (half the bytes; E2B's is 2.3 B values) and gives transformers' logits."""
    import onnx
    import torch
    import transformers as tf
    from tiny_models import make_model

    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.export.exporter import ExportConfig, export

    hf_dir = make_model("gemma4_e", tmp_path / "hf")
    model = tf.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        table = model.model.embed_tokens_per_layer.weight
        table.copy_(table.to(torch.bfloat16).float())
    model.save_pretrained(str(hf_dir))
    export(ExportConfig(str(hf_dir), tmp_path / "export"))
    build_ort(BuildConfig(tmp_path / "export", tmp_path / "engine", attention="llmc", kv_dtype="float32"))
    stored = {i.name for i in onnx.load(str(tmp_path / "engine" / "model.onnx"),
                                        load_external_data=False).graph.initializer}
    assert "embed_per_layer.weight.bf16" in stored and "embed_per_layer.weight" not in stored
    ids = _ids(5, 17)
    engine = load_engine_dir(tmp_path / "engine")
    got = engine.prefill([0], [ids], engine.new_kv_cache(1, 32))[0]
    assert float(np.abs(got - _hf_logits(model, ids)[-1]).max()) <= 1e-4
