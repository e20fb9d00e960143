"""The TensorRT engine's step logic (the step core under `window_layout`) over the lowered graphs, run on the CPU by ONNX Runtime with the
reference `llmc::attention` custom op: what `TrtEngine` does on a GPU, minus TensorRT.

Like `TrtEngine`, every run is checked against the planned optimization profiles, and the KV buffers are
[slots, Hkv, max_seq_len, D] however few positions a cache is asked for.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from llmc.engines.base import KVCache
from llmc.engines.host_kv import HostKVCache
from llmc.engines.ort.build import engine_manifest
from llmc.engines.ort.graphs import load_checkpoint, write_inplace_graphs
from llmc.engines.steps import StepCore, StepLayout, StepRows
from llmc.engines.trt.lower import lower_file
from llmc.engines.trt.plugin import register_ort_reference
from llmc.engines.trt.profiles import GRAPHS, TrtLimits, check_shapes, plan_profiles
from llmc.engines.trt.run import window_layout
from llmc.graph import io_names as io
from llmc.manifest import load_export


def write_graphs(export_dir: Path, out: Path, lowered: bool) -> None:
    """fp32 in-place "onnx"-attention graphs of an export into `out`, lowered to the plugin when asked."""
    export = load_export(export_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_inplace_graphs(load_checkpoint(export_dir, export), out, "float32", export.opset, None, "onnx")
    if lowered:
        for graph in GRAPHS:
            lower_file(out / f"{graph}.onnx", export.model, graph)


def copy_graphs(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def session(path: Path) -> object:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(register_ort_reference())
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class OrtPluginEngine(StepCore):
    def __init__(self, export_dir: Path, graph_dir: Path, limits: TrtLimits) -> None:
        export = load_export(export_dir)
        kv = io.kv_spec(export.model, "float32", layout="inplace")
        prefill, decode = io.inplace_specs(export.model, kv, "onnx")
        self.manifest = engine_manifest(export, export_dir, "ort", "float32", {}, {}, (prefill, decode), kv)
        self.directory = graph_dir
        self.limits = limits
        self.profiles = plan_profiles(limits, prefill, decode)
        self.sessions = {g: session(graph_dir / f"{g}.onnx") for g in GRAPHS}
        self.calls: list[tuple[str, int, tuple[int, ...]]] = []  # (graph, first row, ids shape) per run

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        kv = HostKVCache(self.manifest.kv, num_slots, self.limits.max_seq_len)
        kv.max_len = min(max_len, self.limits.max_seq_len)
        return kv

    def step_layout(self, kv: KVCache) -> StepLayout:
        return window_layout(self.limits)

    def _run(self, graph: str, kv: KVCache, rows: StepRows) -> np.ndarray:
        assert isinstance(kv, HostKVCache)
        first, ids, pos, logits_rows = rows.first, rows.ids, rows.positions, rows.logits_rows
        batch = ids.shape[0]
        buffers = [buf[first:first + batch] for buf in kv.buffers()]
        past, present = self.manifest.kv.names("past"), self.manifest.kv.names("present")
        shapes = {io.INPUT_IDS: ids.shape, io.POSITION_IDS: pos.shape, **{n: b.shape for n, b in zip(past, buffers)}}
        check_shapes(self.profiles[graph], shapes)
        self.calls.append((graph, first, ids.shape))
        import onnxruntime as ort

        sess = self.sessions[graph]
        binding = sess.io_binding()  # type: ignore[attr-defined]
        binding.bind_cpu_input(io.INPUT_IDS, ids)
        binding.bind_cpu_input(io.POSITION_IDS, pos)
        for past_name, present_name, buf in zip(past, present, buffers):
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            binding.bind_ortvalue_input(past_name, value)
            binding.bind_ortvalue_output(present_name, value)
        out_rows = 1 if graph == "prefill" else ids.shape[1]  # what the graph gives
        logits = np.empty((batch, out_rows, self.vocab_size), np.float32)
        binding.bind_output(io.LOGITS, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        sess.run_with_iobinding(binding)  # type: ignore[attr-defined]
        assert out_rows == logits_rows
        return logits
