"""`--backend ort-cuda`: provider selection, the device-buffer binding plan, the clear errors without CUDA, and the
engine's binding logic run on the CPU provider (device "cpu": the same address binding OrtCudaEngine does on CUDA)
against the in-place engine. The CUDA run is the GPU-marked test at the end (scripts/gpu_check.sh runs it)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import Built

from llmc.engines.base import Engine, EngineOptions
from llmc.engines.builders import build
from llmc.engines.ort.config import BuildConfig
from llmc.engines.ort.cuda import (
    CUDA_PROVIDER,
    DeviceKVCache,
    OrtCudaEngine,
    binding_plan,
    cuda_providers,
    write_cuda_engine,
)
from llmc.engines.registry import load_engine_dir
from llmc.errors import BackendUnavailableError, EngineError, InputError
from llmc.graph import io_names as io
from llmc.manifest import KVSpec, load_engine, load_export


def _has_cuda() -> bool:
    import onnxruntime as ort

    return CUDA_PROVIDER in ort.get_available_providers()


no_cuda = pytest.mark.skipif(_has_cuda(), reason="the CUDA provider is here: this checks the error without it")
KV = KVSpec(layout="inplace", dtype="float16", num_layers=2, num_kv_heads=3, head_dim=8, past_key=io.PAST_KEY,
            past_value=io.PAST_VALUE, present_key=io.PRESENT_KEY, present_value=io.PRESENT_VALUE)


def test_providers_put_cuda_first_and_refuse_without_it() -> None:
    assert cuda_providers(["CUDAExecutionProvider", "CPUExecutionProvider"], 1) == [
        ("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
    with pytest.raises(BackendUnavailableError, match=r"--backend ort-cuda needs ONNX Runtime's CUDAExecutionProvider;"
                                                      r" this onnxruntime offers AzureExecutionProvider, "
                                                      r"CPUExecutionProvider: .*pip install 'llmc\[gpu\]'"):
        cuda_providers(["AzureExecutionProvider", "CPUExecutionProvider"])


def test_binding_plan_binds_each_buffers_rows_as_past_and_present() -> None:
    bases = [1000 * (i + 1) for i in range(4)]
    plan = binding_plan(KV, bases, row_bytes=10, max_len=64, first=2, stop=5)
    assert [(b.past, b.present) for b in plan] == list(zip(KV.names("past"), KV.names("present")))
    assert [b.address for b in plan] == [1020, 2020, 3020, 4020]
    assert {b.shape for b in plan} == {(3, 3, 64, 8)}
    with pytest.raises(EngineError, match=r"KV rows 3..2 are not a range"):
        binding_plan(KV, bases, 10, 64, 3, 3)


class CpuDeviceEngine(OrtCudaEngine):
    """OrtCudaEngine's device-buffer binding on the CPU provider."""

    device = "cpu"


def _trace(engine: Engine) -> np.ndarray:
    kv = engine.new_kv_cache(4, 96)
    prompts = [[5, 17, 33, 9, 100, 42, 7], [11, 12], [200, 3, 4, 90, 91, 92]]
    out = [engine.prefill([0, 1, 2], prompts, kv)]
    for step in range(3):
        out.append(engine.decode([0, 1, 2], [[10 + step], [20 + step], [30 + step]], kv))
    out.append(engine.decode([1], [[40, 41, 42, 43]], kv))  # a prompt chunk
    kv.free(0)
    kv.move(2, 0)  # compaction: slot 2's rows copied into slot 0 (a device copy on CUDA)
    out.append(engine.decode([0, 1], [[50], [51]], kv))
    out.append(engine.prefill([2], [[7, 8, 9]], kv))
    return np.concatenate(out)


def test_device_buffers_bound_by_address_match_the_inplace_engine(tiny_llama: Built) -> None:
    folder = tiny_llama.engine("gqa")
    ours = CpuDeviceEngine(load_engine(folder), folder, EngineOptions(threads=1))
    kv = ours.new_kv_cache(2, 32)
    assert isinstance(kv, DeviceKVCache) and kv.keys == [] and kv.values == []  # nothing of it in host arrays
    with pytest.raises(EngineError, match=r"lives on the device"):
        kv.buffers()
    reference = load_engine_dir(folder, EngineOptions(threads=1))
    assert np.abs(_trace(ours) - _trace(reference)).max() <= 1e-5


@no_cuda
def test_loading_or_building_without_cuda_is_a_clear_error(tiny_llama: Built, tmp_path: Path) -> None:
    copy = tmp_path / "engine"
    shutil.copytree(tiny_llama.engine("gqa"), copy)
    data = json.loads((copy / "engine.json").read_text())
    data["backend"] = "ort-cuda"
    (copy / "engine.json").write_text(json.dumps(data))
    with pytest.raises(BackendUnavailableError, match=r"--backend ort-cuda needs ONNX Runtime's "
                                                      r"CUDAExecutionProvider"):
        load_engine_dir(copy)
    with pytest.raises(BackendUnavailableError, match=r"--backend ort-cuda needs"):
        build(BuildConfig(tiny_llama.export_dir, tmp_path / "built", backend="ort-cuda"))
    assert not (tmp_path / "built").exists()


@pytest.mark.parametrize("change, match", [
    ({"quant": "int4"}, r"--quant int4 is not built for --backend ort-cuda"),
    ({"attention": "llmc"}, r"--attention llmc is not built for --backend ort-cuda"),
    ({"kv_layout": "concat"}, r"--kv-layout concat is not built for --backend ort-cuda"),
])
def test_choices_ort_cuda_does_not_build_are_refused(tiny_llama: Built, tmp_path: Path, change: dict,
                                                     match: str) -> None:
    with pytest.raises(InputError, match=match):
        build(BuildConfig(tiny_llama.export_dir, tmp_path / "e", backend="ort-cuda", **change))


def test_chunked_attention_is_refused_naming_the_backends_that_build_it(tiny_llama: Built, tmp_path: Path) -> None:
    """GroupQueryAttention has no chunked attention (Llama 4's rotated layers): the ort-cuda graph is refused."""
    export = load_export(tiny_llama.export_dir)
    model = replace(export.model, attention_chunk=8, layer_types=("chunked_attention",) * export.model.num_layers)
    with pytest.raises(InputError, match=r"no chunked attention .*blocks of 8 positions.*--backend ort"):
        write_cuda_engine(tmp_path, tiny_llama.export_dir, replace(export, model=model), "1.0")


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5_text", "nemotron_h", "falcon_h1", "jamba"])
def test_layers_with_states_are_refused_naming_the_backend_that_builds_them(arch: str,
                                                                           tiny_factory: Callable[[str], Built],
                                                                           tmp_path: Path) -> None:
    """LFM2's conv layers, Qwen3.5's Gated DeltaNet and Mamba-2 mixers keep a state per sequence, which ort-cuda
    does not hold."""
    tiny = tiny_factory(arch)
    with pytest.raises(InputError, match=r"no per-sequence state .*LFM2's, Qwen3.5's or Granite 4.0-H's.*--backend ort"):
        write_cuda_engine(tmp_path, tiny.export_dir, load_export(tiny.export_dir), "1.0")


def test_the_written_engine_is_fp16_gqa_for_cuda(tiny_llama: Built, tmp_path: Path) -> None:
    export = load_export(tiny_llama.export_dir)
    manifest = write_cuda_engine(tmp_path, tiny_llama.export_dir, export, "1.0")
    assert manifest.backend == "ort-cuda" and manifest.precision == "fp16" and manifest.kv.dtype == "float16"
    assert manifest.prefill == manifest.decode and manifest.prefill.file == "model.onnx"
    model = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert ("com.microsoft", "GroupQueryAttention") in ops and not any(d == "ai.llmc" for d, _ in ops)
    past = {i.name: i.type.tensor_type.elem_type for i in model.graph.input if i.name.startswith("past_")}
    assert set(past) == set(manifest.kv.names("past")) and set(past.values()) == {onnx.TensorProto.FLOAT16}
    assert set(manifest.files) >= {"model.onnx", "weights.bin", "golden.npz"}


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs onnxruntime-gpu with the CUDA provider and an NVIDIA GPU")
def test_cuda_engine_agrees_with_the_cpu_engine(tiny_llama: Built, tmp_path: Path) -> None:
    from llmc.runtime.verify import compare_engines

    manifest = build(BuildConfig(tiny_llama.export_dir, tmp_path / "engine", backend="ort-cuda"))
    assert manifest.backend == "ort-cuda" and manifest.settings.parity["top1_agreement"] >= 0.9
    engine = load_engine_dir(tmp_path / "engine")
    assert isinstance(engine, OrtCudaEngine) and CUDA_PROVIDER in engine._prefill.get_providers()  # type: ignore
    prompts = [[5, 17, 33, 9, 100, 42, 7], [11, 12], [200, 3, 4, 90, 91, 92]]
    result = compare_engines(load_engine_dir(tiny_llama.engine("gqa")), engine, prompts, 16)
    assert result["top1_agreement"] >= 0.95, result
    ours, reference = _trace(engine), _trace(load_engine_dir(tiny_llama.engine("gqa")))
    assert np.abs(ours - reference).max() <= 5e-2  # fp16 against fp32



def test_the_fp16_graph_runs_through_the_device_binding(tiny_llama: Built, tmp_path: Path) -> None:
    """What the CUDA engine runs (the fp16 GQA graph), on the CPU provider through the same address binding: the
    fp32 engine's greedy answers, logits within fp16's precision."""
    from llmc.runtime.verify import compare_engines

    manifest = write_cuda_engine(tmp_path, tiny_llama.export_dir, load_export(tiny_llama.export_dir), "1.0")
    engine = CpuDeviceEngine(manifest, tmp_path, EngineOptions(threads=1))
    reference = load_engine_dir(tiny_llama.engine("gqa"), EngineOptions(threads=1))
    prompts = [[5, 17, 33, 9, 100, 42, 7], [11, 12], [200, 3, 4, 90, 91, 92]]
    assert compare_engines(reference, engine, prompts, 16)["top1_agreement"] >= 0.95
    assert np.abs(_trace(engine) - _trace(reference)).max() <= 1e-2
