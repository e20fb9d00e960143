"""TensorRT engines of the tiny llama, built and run where TensorRT imports (an NVIDIA GPU machine): manifest fields,
greedy parity with the ONNX Runtime engine, load checks, present tensors aliased to past ones, static KV axes,
CUDA-graph replay across re-binds and their release on close. Skipped elsewhere, never faked."""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from llmc.engines.ort.build import BuildConfig
from llmc.engines.registry import load_engine_dir
from llmc.engines.trt.build import NATIVE_MIN_TRT, TrtBuildConfig, build_trt, version_tuple
from llmc.engines.trt.profiles import TrtLimits
from llmc.errors import LimitError, ManifestError
from llmc.runtime.verify import compare_engines

pytestmark = [pytest.mark.trt, pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None,
                                 reason="TensorRT is not installed (an NVIDIA GPU machine with pip install "
                                        "'llmc[trt]' runs these)")]

LIMITS = TrtLimits(max_batch_size=4, max_input_len=64, max_seq_len=256, max_num_tokens=8)
PROMPTS = [[5, 17, 33, 9, 100, 42, 7], [11, 12], [200, 3, 4, 90, 91, 92]]


def _attention_kinds() -> list[str]:
    if importlib.util.find_spec("tensorrt") is None:
        return ["plugin"]
    import tensorrt

    return ["plugin"] + (["native"] if version_tuple(tensorrt.__version__) >= NATIVE_MIN_TRT else [])


@pytest.fixture(scope="module", params=_attention_kinds())
def trt_engine_dir(request: pytest.FixtureRequest, tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"trt-{request.param}") / "engine"
    build_trt(TrtBuildConfig(BuildConfig(tiny_llama.export_dir, out, backend="trt"), LIMITS,
                             attention=request.param))
    return out


def test_manifest_records_the_build(trt_engine_dir: Path) -> None:
    import tensorrt

    data = json.loads((trt_engine_dir / "engine.json").read_text())
    settings = data["settings"]
    assert data["backend"] == "trt" and data["precision"] == "fp16" and data["kv"]["dtype"] == "float16"
    assert settings["tensorrt"] == tensorrt.__version__ and settings["compute_capability"].count(".") == 1
    assert settings["profiles"]["prefill"]["input_ids"] == {"min": [1, 1], "opt": [2, 32], "max": [4, 64]}
    assert {"prefill.plan", "decode.plan"} <= set(data["files"]) and (trt_engine_dir / "timing.cache").is_file()
    assert settings["parity"]["top1_agreement"] >= 0.9


def test_greedy_parity_with_onnx_runtime(tiny_llama, trt_engine_dir: Path) -> None:
    result = compare_engines(load_engine_dir(tiny_llama.engine_dir), load_engine_dir(trt_engine_dir), PROMPTS, 16)
    assert result["top1_agreement"] >= 0.95, result
    assert result["greedy_match_min"] >= 8, result


def test_batched_steps_and_cuda_graph_replay(trt_engine_dir: Path) -> None:
    engine = load_engine_dir(trt_engine_dir)
    kv = engine.new_kv_cache(3, 128)
    first = engine.prefill([0, 1, 2], PROMPTS, kv)
    tokens = [[int(t)] for t in first.argmax(-1)]
    steps = [engine.decode([0, 1, 2], tokens, kv) for _ in range(3)]  # same shapes: captured, then replayed
    assert engine._graphs["decode"].graphs  # type: ignore[attr-defined]
    alone = load_engine_dir(trt_engine_dir)
    kv1 = alone.new_kv_cache(3, 128)
    alone.prefill([0, 1, 2], PROMPTS, kv1)
    for i in range(3):
        assert np.abs(alone.decode([0, 1, 2], tokens, kv1) - steps[i]).max() < 1e-3


def test_limits_quote_the_profile(trt_engine_dir: Path) -> None:
    engine = load_engine_dir(trt_engine_dir)
    kv = engine.new_kv_cache(1, 128)
    with pytest.raises(LimitError, match=r"input_ids dimension 1 \(sequence\) is 65.*min 1 / opt 32 / max 64"):
        engine.prefill([0], [list(range(65))], kv)


def test_load_checks_name_both_values(trt_engine_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "engine"
    shutil.copytree(trt_engine_dir, copy)
    data = json.loads((copy / "engine.json").read_text())
    data["settings"]["tensorrt"] = "9.0.0"
    (copy / "engine.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"built with TensorRT 9.0.0, this machine has TensorRT"):
        load_engine_dir(copy)
    with open(copy / "decode.plan", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ManifestError, match=r"decode.plan was modified"):
        load_engine_dir(copy)


def test_rebuild_reuses_the_timing_cache(tiny_llama, trt_engine_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine"
    shutil.copytree(trt_engine_dir, out)
    before = (out / "timing.cache").stat().st_size
    cfg = TrtBuildConfig(BuildConfig(tiny_llama.export_dir, out, backend="trt", force=True), LIMITS)
    manifest = build_trt(replace(cfg, attention=json.loads((out / "engine.json").read_text())["settings"]["attention"]))
    assert manifest.backend == "trt" and (out / "timing.cache").stat().st_size >= before


def test_present_tensors_alias_the_past_ones(trt_engine_dir: Path) -> None:
    """The load check (check_aliases) ran; here the engine's own answer, per graph and layer, and the static axis."""
    engine = load_engine_dir(trt_engine_dir)
    kv = engine.manifest.kv
    for graph in engine._graphs.values():  # type: ignore[attr-defined]
        plan = graph.engine
        assert hasattr(plan, "get_aliased_input_tensor"), "these TensorRT bindings cannot report aliases"
        assert [plan.get_aliased_input_tensor(p) for p in kv.names("present")] == kv.names("past")
        assert plan.get_tensor_shape(kv.names("past")[0])[2] == LIMITS.max_seq_len  # static, not -1


def test_captures_do_not_outlive_their_binding(trt_engine_dir: Path) -> None:
    """Shapes A, A, A (captured, replayed), B, B, then A again: the same logits as an engine that never captured."""
    def steps(engine) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
        kv = engine.new_kv_cache(3, 128)
        engine.prefill([0, 1, 2], PROMPTS, kv)
        out = []
        for rows in ([0, 1], [0, 1], [0, 1], [0, 1, 2], [0, 1, 2], [0, 1], [0, 1]):
            out.append(engine.decode(rows, [[7 + len(out)] for _ in rows], kv))
        return out

    engine = load_engine_dir(trt_engine_dir)
    ours = steps(engine)
    assert engine._graphs["decode"].graphs  # type: ignore[attr-defined]
    plain = load_engine_dir(trt_engine_dir)
    plain._graphs["decode"].capture = False  # type: ignore[attr-defined]  # every step a plain enqueue
    for a, b in zip(ours, steps(plain)):
        assert np.abs(a - b).max() < 1e-3
    engine.close()  # type: ignore[attr-defined]
    assert not engine._graphs["decode"].graphs  # type: ignore[attr-defined]
    plain.close()  # type: ignore[attr-defined]
