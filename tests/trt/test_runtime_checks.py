"""TrtEngine's load checks and step logic with plain values (CPU only; the GPU runs are in test_trt_engine.py)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from runtime.fake_engine import fake_manifest

from llmc.engines.base import KVCache
from llmc.engines.host_kv import HostKVCache
from llmc.engines.registry import load_engine_dir
from llmc.engines.steps import StepCore, StepLayout, StepRows
from llmc.engines.trt.profiles import TrtLimits, plan_profiles
from llmc.engines.trt.run import check_build_env, check_profile, check_tensor_names, window_layout
from llmc.errors import BackendUnavailableError, ManifestError
from llmc.graph import io_names as io
from llmc.manifest import EngineSettings, save

from .test_profiles import MODEL

SETTINGS = EngineSettings(tensorrt="10.13.0.35", compute_capability="9.0", gpu="NVIDIA H200")


def test_versions_and_capability_must_match() -> None:
    check_build_env(SETTINGS, "10.13.0.35", "9.0", "NVIDIA H100")  # same capability: another H-series GPU is fine
    with pytest.raises(ManifestError, match=r"built with TensorRT 10.13.0.35, this machine has TensorRT 10.9.0"):
        check_build_env(SETTINGS, "10.9.0", "9.0", "NVIDIA H200")
    with pytest.raises(ManifestError, match=r"built for compute capability 9.0 \(NVIDIA H200\), this GPU is 8.9 "
                                            r"\(NVIDIA L4\): rebuild it on this GPU"):
        check_build_env(SETTINGS, "10.13.0.35", "8.9", "NVIDIA L4")


def test_tensor_names_report_both_differences() -> None:
    check_tensor_names("decode.plan", "inputs", ["a", "b"], ["b", "a"])
    with pytest.raises(ManifestError, match=r"decode.plan: inputs differ from the manifest: missing \['position_ids'\]"
                                            r", unexpected \['attention_mask', 'seqlens_k'\]"):
        check_tensor_names("decode.plan", "inputs", ["input_ids", "position_ids"],
                           ["input_ids", "attention_mask", "seqlens_k"])


def test_engine_profile_must_be_the_recorded_one() -> None:
    kv = io.kv_spec(MODEL, "float16", layout="inplace")
    profile = plan_profiles(TrtLimits(max_batch_size=4), *io.inplace_specs(MODEL, kv, "onnx"))["decode"]
    engine = {name: (r.min, r.opt, r.max) for name, r in profile.inputs.items()}
    check_profile("decode.plan", profile, engine)
    engine["input_ids"] = ((1, 1), (2, 1), (8, 1))
    with pytest.raises(ManifestError, match=r"decode.plan: input input_ids has profile .*\(8, 1\).* the manifest "
                                            r"records .*\(4, 1\)"):
        check_profile("decode.plan", profile, engine)


class RecordingSteps(StepCore):
    """The step core under TensorRT's layout over a `_run` that records its inputs; logits row b is filled with
    first + b (the cache row)."""

    def __init__(self, limits: TrtLimits) -> None:
        self.manifest = replace(fake_manifest(vocab_size=8))
        self.limits = limits
        self.calls: list[tuple[str, int, list[list[int]], list[list[int]]]] = []

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        return HostKVCache(self.manifest.kv, num_slots, max_len)

    def step_layout(self, kv: KVCache) -> StepLayout:
        return window_layout(self.limits)

    def _run(self, graph: str, kv: KVCache, rows: StepRows) -> np.ndarray:
        first, ids = rows.first, rows.ids
        self.calls.append((graph, first, ids.tolist(), rows.positions.tolist()))
        at = np.arange(first, first + ids.shape[0], dtype=np.float32)
        return np.broadcast_to(at[:, None, None], (ids.shape[0], rows.logits_rows, self.vocab_size)).copy()


def test_decode_runs_dummy_rows_at_their_length() -> None:
    steps = RecordingSteps(TrtLimits(max_batch_size=8, max_num_tokens=4))
    kv = steps.new_kv_cache(4, 32)
    kv.lengths[:] = [3, 5, 2, 0]
    logits = steps.decode([2, 0], [[20], [10]], kv)
    assert steps.calls == [("decode", 0, [[10], [0], [20]], [[3], [5], [2]])]  # row 1: a dummy token at 5
    assert logits[:, 0].tolist() == [2.0, 0.0] and kv.lengths.tolist() == [4, 5, 3, 0]


def test_decode_windows_and_prefill_groups_fit_max_batch() -> None:
    steps = RecordingSteps(TrtLimits(max_batch_size=2, max_num_tokens=4))
    kv = steps.new_kv_cache(5, 32)
    out = steps.prefill([0, 1, 2, 4], [[1, 2], [3], [4, 5, 6], [7]], kv)
    assert [(c[0], c[1], len(c[2])) for c in steps.calls] == [("prefill", 0, 2), ("prefill", 2, 1), ("prefill", 4, 1)]
    assert out[:, 0].tolist() == [0.0, 1.0, 2.0, 4.0]
    steps.calls.clear()
    out = steps.decode([4, 0, 1], [[9], [8], [7]], kv)
    assert [(c[1], len(c[2])) for c in steps.calls] == [(0, 2), (4, 1)]
    assert out[:, 0].tolist() == [4.0, 0.0, 1.0]


def test_chunks_longer_than_max_num_tokens_are_split() -> None:
    steps = RecordingSteps(TrtLimits(max_batch_size=2, max_num_tokens=3))
    kv = steps.new_kv_cache(2, 32)
    kv.lengths[1] = 4
    steps.decode([1], [[1, 2, 3, 4, 5, 6, 7]], kv)
    assert [(c[2], c[3]) for c in steps.calls] == [([[1, 2, 3]], [[4, 5, 6]]), ([[4, 5, 6]], [[7, 8, 9]]),
                                                   ([[7]], [[10]])]
    assert kv.lengths.tolist() == [0, 11]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_loading_a_trt_engine_without_tensorrt_is_a_clear_error(tmp_path: Path) -> None:
    kv = io.kv_spec(MODEL, "float16", layout="inplace")
    prefill, decode = io.inplace_specs(MODEL, kv, "onnx")
    manifest = replace(fake_manifest(), backend="trt", model=MODEL, kv=kv, prefill=prefill, decode=decode,
                       settings=replace(SETTINGS, limits={"max_batch_size": 8}, attention="plugin"))
    save(manifest, tmp_path)
    with pytest.raises(BackendUnavailableError, match=r"TensorRT is not installed: pip install 'llmc\[trt\]'"):
        load_engine_dir(tmp_path)
