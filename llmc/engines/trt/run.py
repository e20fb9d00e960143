"""TensorRT engine: prefill.plan and decode.plan over one KV memory on the GPU.

The KV cache is one device buffer [slots, Hkv, max_seq_len, D] per layer and kind, allocated once and bound with
set_tensor_address as both past and present (the attention plugin writes each step's K/V in place). Shapes are
checked against the engine's optimization profiles before every run; a decode step whose shapes repeat is captured
in a CUDA graph and replayed. Captures belong to the binding they were made under: re-binding the context (other
rows, shapes or cache) destroys them, and close() frees them with the stream. At load, each present tensor must be
reported aliased to its past tensor (the one address bound to both). CUDA goes through cuda-python (the `trt` extra);
tensorrt and cuda are imported lazily so the load checks and the step logic import (and are tested) anywhere.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmc.engines.base import EngineOptions, KVCache
from llmc.engines.steps import StepCore, StepLayout, StepRows
from llmc.engines.trt.profiles import GRAPHS, Profile, TrtLimits, check_shapes
from llmc.errors import BackendUnavailableError, EngineError, LimitError, ManifestError
from llmc.graph import io_names as io
from llmc.manifest import EngineManifest, EngineSettings, verify_files

# -- load checks (pure) -----------------------------------------------------------------------------------------


def check_build_env(settings: EngineSettings, tensorrt_version: str, compute_capability: str, gpu: str) -> None:
    """An engine runs only under the TensorRT version and on the compute capability it was built for."""
    built_trt, built_cc = settings.tensorrt, settings.compute_capability
    if built_trt != tensorrt_version:
        raise ManifestError(f"engine was built with TensorRT {built_trt}, this machine has TensorRT "
                            f"{tensorrt_version}: rebuild it here with llmc build --backend trt")
    if built_cc != compute_capability:
        raise ManifestError(f"engine was built for compute capability {built_cc} ({settings.gpu}), this GPU "
                            f"is {compute_capability} ({gpu}): rebuild it on this GPU")


def check_tensor_names(file: str, kind: str, expected: Sequence[str], actual: Sequence[str]) -> None:
    """Compare the manifest's tensor names with the engine's and report both differences (as TensorRT-LLM does)."""
    missing, unexpected = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing or unexpected:
        raise ManifestError(f"{file}: {kind} differ from the manifest: missing {missing[:4]}, "
                            f"unexpected {unexpected[:4]}")


def check_aliases(file: str, engine: Any, past: Sequence[str], present: Sequence[str], attention: str) -> None:
    """Each present.* must alias its past_key_values.* (TensorRT binds them to one address). Bindings without
    `get_aliased_input_tensor` cannot say: nothing is checked there."""
    aliased = getattr(engine, "get_aliased_input_tensor", None)
    if aliased is None:
        return
    for p, q in zip(past, present):
        got = aliased(q)
        if got != p:
            why = ("the plugin's outputs alias its cache inputs only when the build enables "
                   "PreviewFeature.ALIASED_PLUGIN_IO_10_03" if attention == "plugin" else
                   "TensorRT did not turn the cache write into an in-place update")
            raise EngineError(f"{file}: output {q} is not aliased to input {p} (TensorRT reports {got!r}); "
                              f"{why}: rebuild the engine with this llmc")


def window_layout(limits: TrtLimits) -> StepLayout:
    """TensorRT's runs: windows of consecutive slots (the plugin's slot buffers) within the profiles' limits."""
    return StepLayout(window=True, equal_new=True, max_rows=limits.max_batch_size, max_new=limits.decode_tokens)


# -- CUDA through cuda-python ------------------------------------------------------------------------------------


def cudart() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime  # cuda-python < 12.6
        except ImportError:
            raise BackendUnavailableError("cuda-python is not installed: pip install 'llmc[trt]'") from None
    return runtime


def cuda_call(result: Any) -> Any:
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise EngineError(f"CUDA call failed: {err}")
    return values[0] if len(values) == 1 else tuple(values)


def stream_handle(stream: Any) -> int:
    """The stream's address for TensorRT: cuda-bindings' documented get_cuda_native_handle where it exists
    (int(stream) is deprecated from 12.9 on), else getPtr(), else int()."""
    try:
        from cuda.bindings.utils import get_cuda_native_handle
    except ImportError:
        get_cuda_native_handle = None
    if get_cuda_native_handle is not None:
        return int(get_cuda_native_handle(stream))
    if hasattr(stream, "getPtr"):
        return int(stream.getPtr())
    return int(stream)


def gpu_info(device: int = 0) -> tuple[str, str]:
    """(GPU name, compute capability "major.minor"); a clear error where there is no CUDA GPU."""
    rt = cudart()
    err, count = rt.cudaGetDeviceCount()
    if int(err) != 0 or count < 1:
        raise BackendUnavailableError(f"no CUDA GPU is visible ({err}): the trt backend needs an NVIDIA GPU")
    prop = cuda_call(rt.cudaGetDeviceProperties(device))
    name = prop.name.decode(errors="replace").rstrip("\0") if isinstance(prop.name, bytes) else str(prop.name)
    return name, f"{prop.major}.{prop.minor}"


class PinnedArray:
    """Page-locked host memory seen as a numpy array (stable address: async copies and CUDA graphs)."""

    def __init__(self, size: int, dtype: type) -> None:
        self._rt = cudart()
        nbytes = size * np.dtype(dtype).itemsize
        self.ptr = int(cuda_call(self._rt.cudaMallocHost(nbytes)))
        buf = memoryview((ctypes.c_byte * nbytes).from_address(self.ptr)).cast("B")
        self.array: np.ndarray = np.frombuffer(buf, dtype=dtype, count=size)

    def __del__(self) -> None:
        self._rt.cudaFreeHost(self.ptr)


class DeviceArray:
    def __init__(self, nbytes: int) -> None:
        self._rt = cudart()
        self.nbytes = nbytes
        self.ptr = int(cuda_call(self._rt.cudaMalloc(nbytes)))
        cuda_call(self._rt.cudaMemset(self.ptr, 0, nbytes))

    def __del__(self) -> None:
        self._rt.cudaFree(self.ptr)


class TrtKVCache(KVCache):
    """Per layer one K and one V device buffer [num_slots, Hkv, buffer_len, D] (fp16), allocated once."""

    def __init__(self, manifest: EngineManifest, num_slots: int, max_len: int, buffer_len: int) -> None:
        super().__init__(num_slots, max_len)
        kv = manifest.kv
        self.row_bytes = kv.num_kv_heads * buffer_len * kv.head_dim * (2 if kv.dtype == "float16" else 4)
        self.names = kv.names("past")
        self.buffers = [DeviceArray(num_slots * self.row_bytes) for _ in self.names]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def address(self, index: int, slot: int) -> int:
        """Device address of row `slot` of buffer `index` (KVSpec.names order)."""
        return self.buffers[index].ptr + slot * self.row_bytes

    def move(self, src: int, dst: int) -> None:
        rt = cudart()
        for i in range(len(self.buffers)):
            cuda_call(rt.cudaMemcpy(self.address(i, dst), self.address(i, src), self.row_bytes,
                                    rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice))
        self.lengths[dst], self.lengths[src] = self.lengths[src], 0


# -- the engine ----------------------------------------------------------------------------------------------------


def check_profile(file: str, profile: Profile, engine_shapes: Mapping[str, Sequence[Sequence[int]]]) -> None:
    """The engine's own (min, opt, max) per input must be the ones recorded in the manifest."""
    for name, r in profile.inputs.items():
        actual = tuple(tuple(int(d) for d in shape) for shape in engine_shapes[name])
        if actual != (r.min, r.opt, r.max):
            raise ManifestError(f"{file}: input {name} has profile {actual} in the engine, the manifest records "
                                f"{(r.min, r.opt, r.max)}")


class _TrtGraph:
    """One plan: its execution context, stable device I/O buffers with pinned host mirrors, captured CUDA graphs."""

    def __init__(self, trt: Any, runtime: Any, path: Path, profile: Profile, manifest: EngineManifest,
                 stream: Any, rows: int, logits_rows: int) -> None:
        spec = getattr(manifest, profile.graph)
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise EngineError(f"TensorRT could not load {path.name} (see its log above)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        check_tensor_names(path.name, "inputs", spec.input_names(), inputs)
        check_tensor_names(path.name, "outputs", spec.output_names(), [n for n in names if n not in inputs])
        check_profile(path.name, profile, {n: self.engine.get_tensor_profile_shape(n, 0) for n in inputs})
        self.profile, self.stream, self.vocab = profile, stream, manifest.model.logits_size
        self.handle = stream_handle(stream)
        self.present = manifest.kv.names("present")
        check_aliases(path.name, self.engine, manifest.kv.names("past"), self.present, manifest.settings.attention)
        self.context = self.engine.create_execution_context()
        self.host = {io.INPUT_IDS: PinnedArray(rows, np.int64), io.POSITION_IDS: PinnedArray(rows, np.int64)}
        self.device = {name: DeviceArray(rows * 8) for name in self.host}
        self.logits = PinnedArray(logits_rows * self.vocab, np.float32)
        self.device[io.LOGITS] = DeviceArray(logits_rows * self.vocab * 4)
        self.capture = profile.graph == "decode"
        self.bound: tuple[int, ...] | None = None  # (id(kv), first row, B, S) the context is bound for
        self.runs = 0  # runs since it was bound
        self.graphs: dict[tuple[int, ...], Any] = {}  # the bound key -> its instantiated CUDA graph (at most one)

    def drop_graphs(self) -> None:
        """Destroy the captures: they replay the context's state at capture, which a re-bind changes."""
        if not self.graphs:
            return
        rt = cudart()
        for exe in self.graphs.values():
            cuda_call(rt.cudaGraphExecDestroy(exe))
        self.graphs.clear()

    def reset(self) -> None:
        self.drop_graphs()
        self.bound = None

    def close(self) -> None:
        self.reset()
        self.context = None

    def _bind(self, kv: TrtKVCache, first: int, shapes: Mapping[str, tuple[int, ...]]) -> None:
        ctx = self.context
        addresses = {name: buf.ptr for name, buf in self.device.items()}
        for i, (past, present) in enumerate(zip(kv.names, self.present)):
            addresses[past] = addresses[present] = kv.address(i, first)  # one buffer, written in place
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise EngineError(f"TensorRT refused shape {shape} for {self.profile.graph} input {name}")
        for name, address in addresses.items():
            if not ctx.set_tensor_address(name, address):
                raise EngineError(f"TensorRT refused address {address:#x} for {self.profile.graph} tensor {name}")

    def _enqueue(self, count: int, out_count: int) -> None:
        rt = cudart()
        to_dev, to_host = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for name, host in self.host.items():
            cuda_call(rt.cudaMemcpyAsync(self.device[name].ptr, host.ptr, count * 8, to_dev, self.stream))
        if not self.context.execute_async_v3(self.handle):
            raise EngineError(f"TensorRT failed to run the {self.profile.graph} engine")
        cuda_call(rt.cudaMemcpyAsync(self.logits.ptr, self.device[io.LOGITS].ptr, out_count * 4, to_host,
                                     self.stream))

    def _captured(self, count: int, out_count: int) -> Any:
        rt = cudart()
        cuda_call(rt.cudaStreamBeginCapture(self.stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
        try:
            self._enqueue(count, out_count)
        finally:
            graph = cuda_call(rt.cudaStreamEndCapture(self.stream))
        try:
            return cuda_call(rt.cudaGraphInstantiate(graph, 0))
        finally:
            cuda_call(rt.cudaGraphDestroy(graph))  # the executable graph does not need it

    def run(self, kv: TrtKVCache, first: int, ids: np.ndarray, pos: np.ndarray, logits_rows: int,
            shapes: Mapping[str, tuple[int, ...]]) -> np.ndarray:
        count, out_count = ids.size, ids.shape[0] * logits_rows * self.vocab
        self.host[io.INPUT_IDS].array[:count] = ids.ravel()
        self.host[io.POSITION_IDS].array[:count] = pos.ravel()
        key = (id(kv), first, *ids.shape)
        if key != self.bound:  # other rows, shapes or cache: re-bind, and the captures made before are void
            self.drop_graphs()
            self._bind(kv, first, shapes)
            self.bound, self.runs = key, 0
        # Capture only after one plain run under this binding: TensorRT wants one after a shape change.
        if self.capture and key not in self.graphs and self.runs > 0:
            self.graphs[key] = self._captured(count, out_count)
        elif key not in self.graphs:
            self._enqueue(count, out_count)
        self.runs += 1
        if key in self.graphs:
            cuda_call(cudart().cudaGraphLaunch(self.graphs[key], self.stream))
        cuda_call(cudart().cudaStreamSynchronize(self.stream))
        return self.logits.array[:out_count].reshape(ids.shape[0], logits_rows, self.vocab).copy()


def _tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError:
        raise BackendUnavailableError("TensorRT is not installed: pip install 'llmc[trt]' on an NVIDIA GPU "
                                      "machine") from None
    return tensorrt


class TrtEngine(StepCore):
    """The step core (steps.py) over TensorRT plans: windows of consecutive slots, split to the engine's limits."""

    def __init__(self, manifest: EngineManifest, directory: Path, options: EngineOptions) -> None:
        self.manifest, self.directory = manifest, Path(directory)
        verify_files(self.directory, manifest.files)
        settings = manifest.settings
        self.limits = TrtLimits(**settings.limits)
        self.kv_budget_mb = options.kv_budget_mb
        trt = _tensorrt()
        gpu, capability = gpu_info()
        check_build_env(settings, trt.__version__, capability, gpu)
        if settings.attention == "plugin":
            from llmc.engines.trt.plugin import register_trt_plugin

            register_trt_plugin()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._stream = cuda_call(cudart().cudaStreamCreate())
        rows = {"prefill": self.limits.max_input_len, "decode": self.limits.decode_tokens}
        logits = {"prefill": 1, "decode": self.limits.decode_tokens}
        self._graphs = {}
        for graph in GRAPHS:
            spec = getattr(manifest, graph)
            profile = Profile.from_json(graph, spec, settings.profiles[graph])
            batch = self.limits.max_batch_size
            self._graphs[graph] = _TrtGraph(trt, self._runtime, self.directory / spec.file, profile, manifest,
                                            self._stream, batch * rows[graph], batch * logits[graph])

    @property
    def max_positions(self) -> int:
        return min(self.manifest.model.max_positions, self.limits.max_seq_len)

    def close(self) -> None:
        """Free the CUDA graphs, the execution contexts and the stream (the engine cannot run afterwards)."""
        for graph in self._graphs.values():
            graph.close()
        if self._stream is not None:
            cuda_call(cudart().cudaStreamDestroy(self._stream))
            self._stream = None

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        need = num_slots * self.limits.max_seq_len * self.kv_bytes_per_token()
        if need > self.kv_budget_mb * 2**20:
            raise LimitError(f"{num_slots} KV slots of {self.limits.max_seq_len} positions (the engine's "
                             f"--max-seq-len) need {need / 2**20:.0f} MiB, the KV budget is {self.kv_budget_mb} MiB: "
                             "raise --kv-budget-mb, run fewer sequences or rebuild with a smaller --max-seq-len")
        for graph in self._graphs.values():
            graph.reset()
        return TrtKVCache(self.manifest, num_slots, min(max_len, self.max_positions), self.limits.max_seq_len)

    def step_layout(self, kv: KVCache) -> StepLayout:
        return window_layout(self.limits)

    def _run(self, graph: str, kv: KVCache, rows: StepRows) -> np.ndarray:
        assert isinstance(kv, TrtKVCache)
        m = self.manifest.kv
        ids, pos = rows.ids, rows.positions
        shapes = {io.INPUT_IDS: ids.shape, io.POSITION_IDS: pos.shape,
                  **{n: (ids.shape[0], m.num_kv_heads, self.limits.max_seq_len, m.head_dim) for n in kv.names}}
        check_shapes(self._graphs[graph].profile, shapes)
        return self._graphs[graph].run(kv, rows.first, ids, pos, rows.logits_rows, shapes)
