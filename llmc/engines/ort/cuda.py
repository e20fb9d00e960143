"""`--backend ort-cuda`: ONNX Runtime's CUDA execution provider over the in-place graphs, the KV cache on the device.

The engine is OrtInplaceEngine (the same step logic, scheduler and sampler) with two differences: its sessions run
on CUDA first (CPU for what CUDA lacks), and its KV cache is one device buffer [slots, Hkv, max_len, D] per layer and
kind (OrtValues allocated on the device once) whose rows first..stop-1 are bound by address (IOBinding, no copy) as
both past and present. Token inputs and logits stay host arrays: ONNX Runtime copies them each run.

The graphs: fp16 with GroupQueryAttention (its CUDA kernel runs fp16 / bf16 only), no quantization, llmc's CPU
operators never; ONNX Runtime optimizes them for CUDA when the session is made (no CPU-optimized file is stored).
`onnxruntime-gpu` (the `gpu` extra) provides the CUDA provider; it replaces the CPU `onnxruntime` (docs/tensorrt.md).
"""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from llmc.engines.base import EngineOptions, KVCache
from llmc.engines.choices import Attention, KVDtype, KVLayout, MatMul, Quant
from llmc.engines.host_kv import HostKVCache, HostPagedKVCache
from llmc.engines.ort.build import RUNTIME_FILES, engine_manifest
from llmc.engines.ort.config import BuildConfig
from llmc.engines.ort.inplace import OrtInplaceEngine
from llmc.engines.ort.run import CPU_PROVIDER
from llmc.errors import BackendUnavailableError, EngineError, InputError
from llmc.manifest import (
    EngineManifest,
    EngineSettings,
    ExportManifest,
    KVSpec,
    load_export,
    save,
    sha256_file,
)
from llmc.progress import Progress, Quiet

CUDA_PROVIDER = "CUDAExecutionProvider"
BACKEND = "ort-cuda"
_NP = {"float16": np.float16, "float32": np.float32}


def cuda_providers(available: Sequence[str], device_id: int = 0) -> list[Any]:
    """The sessions' providers: CUDA on `device_id`, then CPU for the nodes CUDA has no kernel for; a clear error
    where this onnxruntime has no CUDA provider (the CPU package, or no GPU build)."""
    if CUDA_PROVIDER not in available:
        raise BackendUnavailableError(
            f"--backend ort-cuda needs ONNX Runtime's {CUDA_PROVIDER}; this onnxruntime offers "
            f"{', '.join(available) or 'none'}: on an NVIDIA GPU machine pip install 'llmc[gpu]' (onnxruntime-gpu "
            "replaces onnxruntime, see docs/tensorrt.md), or use --backend ort")
    return [(CUDA_PROVIDER, {"device_id": device_id}), CPU_PROVIDER]


@dataclass(frozen=True)
class KVBinding:
    """One KV buffer's rows bound for a run: the same device address as input `past` and output `present`."""

    past: str
    present: str
    address: int
    shape: tuple[int, int, int, int]


def binding_plan(kv: KVSpec, bases: Sequence[int], row_bytes: int, max_len: int, first: int,
                 stop: int) -> list[KVBinding]:
    """Rows first..stop-1 of every buffer (KVSpec.names order, each at address bases[i]) as [stop - first, Hkv,
    max_len, D] tensors: contiguous, so one address each, bound as past and present."""
    if not 0 <= first < stop:
        raise EngineError(f"KV rows {first}..{stop - 1} are not a range")
    shape = (stop - first, kv.num_kv_heads, max_len, kv.row_width)
    return [KVBinding(past, present, base + first * row_bytes, shape)
            for past, present, base in zip(kv.names("past"), kv.names("present"), bases)]


class DeviceKVCache(HostKVCache):
    """Per layer one K and one V buffer [num_slots, Hkv, max_len, D] in `device` memory (ONNX Runtime OrtValues),
    allocated once. A HostKVCache to the in-place engine's step logic, but it holds no host arrays: rows are bound by
    address (`plan`), moved by a device copy."""

    def __init__(self, spec: KVSpec, num_slots: int, max_len: int, device: str = "cuda", device_id: int = 0) -> None:
        KVCache.__init__(self, num_slots, max_len)  # not HostKVCache's host buffers
        import onnxruntime as ort

        if spec.dtype not in _NP:
            raise InputError(f"--backend ort-cuda keeps a float16 or float32 KV cache, the engine's is {spec.dtype}")
        self.spec, self.device, self.device_id = spec, device, device_id
        self.dtype = _NP[spec.dtype]
        shape = [num_slots, spec.num_kv_heads, max_len, spec.row_width]
        self.row_bytes = int(np.prod(shape[1:])) * np.dtype(self.dtype).itemsize
        self.device_buffers = [ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype, device, device_id)
                               for _ in spec.names("past")]
        self.bases = [int(v.data_ptr()) for v in self.device_buffers]
        self.keys, self.values, self.states = [], [], []  # no host copies (nor states: see write_cuda_engine)
        self._copied, self._pooled = [], []
        for base in self.bases:  # finite contents from the start (ONNX Runtime does not clear what it allocates)
            self._zero(base, num_slots * self.row_bytes)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.row_bytes * len(self.bases)

    def buffers(self) -> list[np.ndarray]:
        raise EngineError("the ort-cuda KV cache lives on the device: bind its rows by address (plan)")

    def plan(self, first: int, stop: int) -> list[KVBinding]:
        return binding_plan(self.spec, self.bases, self.row_bytes, self.max_len, first, stop)

    def move(self, src: int, dst: int) -> None:
        for base in self.bases:
            self._copy(base + dst * self.row_bytes, base + src * self.row_bytes, self.row_bytes)
        self.lengths[dst], self.lengths[src] = self.lengths[src], 0

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        if self.device == "cpu":
            ctypes.memmove(dst, src, nbytes)
            return
        from llmc.engines.trt.run import cuda_call, cudart

        rt = cudart()
        cuda_call(rt.cudaMemcpy(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice))

    def _zero(self, address: int, nbytes: int) -> None:
        if self.device == "cpu":
            ctypes.memset(address, 0, nbytes)
            return
        from llmc.engines.trt.run import cuda_call, cudart

        cuda_call(cudart().cudaMemset(address, 0, nbytes))


class OrtCudaEngine(OrtInplaceEngine):
    """The in-place ONNX Runtime engine on CUDA. `device` "cpu" runs the same device-buffer binding on the CPU
    provider (tests)."""

    device = "cuda"

    def __init__(self, manifest: EngineManifest, directory: Path, options: EngineOptions, device_id: int = 0) -> None:
        import onnxruntime as ort

        self.device_id = device_id
        if self.device == "cuda":
            self.providers = tuple(cuda_providers(ort.get_available_providers(), device_id))
        super().__init__(manifest, directory, options)
        if self.device == "cuda":
            got = self._prefill.get_providers()  # type: ignore[attr-defined]
            if CUDA_PROVIDER not in got:  # onnxruntime falls back to the CPU when CUDA / cuDNN cannot load
                raise BackendUnavailableError(f"ONNX Runtime could not start its CUDA provider (the session runs on "
                                              f"{', '.join(got)}): check the CUDA and cuDNN libraries onnxruntime-gpu "
                                              "needs")

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        self._bindings.clear()
        self._steps.clear()
        return DeviceKVCache(self.manifest.kv, num_slots, min(max_len, self.max_positions), self.device,
                             self.device_id)

    def _kv_binding(self, session: object, kv: HostKVCache | HostPagedKVCache, first: int, stop: int) -> tuple[object, list[object]]:
        if not isinstance(kv, DeviceKVCache):
            raise EngineError("an ort-cuda engine runs on its own KV cache (new_kv_cache)")
        binding = session.io_binding()  # type: ignore[attr-defined]
        for b in kv.plan(first, stop):
            binding.bind_input(b.past, self.device, self.device_id, kv.dtype, list(b.shape), b.address)
            binding.bind_output(b.present, self.device, self.device_id, kv.dtype, list(b.shape), b.address)
        return binding, [kv]  # the cache stays referenced as long as the binding


# -- the build ---------------------------------------------------------------------------------------------------


def check_cuda_config(cfg: BuildConfig) -> None:
    """ort-cuda engines are fp16 in-place GroupQueryAttention graphs: the choices that would be something else."""
    wrong = [(flag, value) for flag, value, ok in (
        ("--kv-layout", cfg.kv_layout, cfg.kv_layout is KVLayout.inplace),
        ("--quant", cfg.quant, cfg.quant is Quant.none),
        ("--attention", cfg.attention, cfg.attention in (Attention.auto, Attention.gqa)),
        ("--kv-dtype", cfg.kv_dtype, cfg.kv_dtype in (KVDtype.auto, KVDtype.float16)),
        ("--matmul", cfg.matmul, cfg.matmul in (MatMul.auto, MatMul.ort))) if not ok]
    if wrong:
        flag, value = wrong[0]
        raise InputError(f"{flag} {value.value} is not built for --backend ort-cuda (fp16, in place, "
                         "GroupQueryAttention, no quantization); use --backend ort for it")


def write_cuda_engine(work: Path, export_dir: Path, export: ExportManifest, onnxruntime_version: str
                      ) -> EngineManifest:
    """The engine folder without its golden check: fp16 GQA in-place graph (one model.onnx), weights, runtime files
    and the manifest (backend ort-cuda)."""
    from llmc.engines.ort.graphs import load_checkpoint, write_inplace_graphs
    from llmc.engines.trt.build import fp16_checkpoint

    if export.model.attention_chunk:
        raise InputError(f"--backend ort-cuda builds GroupQueryAttention, which has no chunked attention (this "
                         f"model's layers see blocks of {export.model.attention_chunk} positions): use --backend ort "
                         "or trt --attention native")
    if export.model.has_states:
        raise InputError("--backend ort-cuda keeps KV memory on the GPU and no per-sequence state beside it (this "
                         "model's convolution, linear-attention or Mamba-2 layers, LFM2's, Qwen3.5's or Granite "
                         "4.0-H's, need one): use --backend ort")
    if export.model.per_layer_attention:
        raise InputError("--backend ort-cuda binds one KV shape for every layer (this model's layers differ in head "
                         "size or read each other's caches: Gemma 4's): use --backend ort")
    if any(export.model.index_layers):
        raise InputError(f"--backend ort-cuda: this model's indexed attention (Kolibri 1.1: each query's keys chosen "
                         f"past {export.model.index_budget} of them) has not run on a GPU here: use --backend ort")
    ckpt = fp16_checkpoint(load_checkpoint(export_dir, export))
    kv, prefill, decode = write_inplace_graphs(ckpt, work, "float16", export.opset, None, "gqa", one_graph=True,
                                               moe="standard")
    for file in RUNTIME_FILES:
        if (export_dir / file).is_file():
            shutil.copy2(export_dir / file, work / file)
    files = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file()}
    settings = EngineSettings(kv_layout="inplace", attention="gqa", precision="fp16", kv_dtype="float16",
                              quant="none", matmul="ort", moe="standard", optimization="extended, at load",
                              onnxruntime=onnxruntime_version)
    return engine_manifest(export, export_dir, BACKEND, "fp16", settings, files, (prefill, decode), kv)


def build_ort_cuda(cfg: BuildConfig, progress: Progress | None = None) -> EngineManifest:
    """`llmc build --backend ort-cuda`: needs the CUDA provider here (the golden check runs on the GPU)."""
    import onnxruntime as ort

    from llmc.engines.ort.config import check_build_config
    from llmc.engines.registry import load_engine_dir
    from llmc.golden import Golden
    from llmc.manifest import verify_files
    from llmc.outdir import atomic_dir
    from llmc.runtime.verify import check_golden

    progress = progress or Quiet()
    check_build_config(cfg)
    check_cuda_config(cfg)
    cuda_providers(ort.get_available_providers())
    export_dir = Path(cfg.export_dir)
    export = load_export(export_dir)
    progress.step(f"checking export {export_dir} ({export.model_name}, {export.dtype})")
    verify_files(export_dir, export.files)
    with atomic_dir(cfg.out_dir, export_dir, "export") as work:
        progress.step("writing the fp16 in-place GroupQueryAttention graph")
        manifest = write_cuda_engine(work, export_dir, export, ort.__version__)
        save(manifest, work)
        progress.step("checking the engine against the golden outputs (CUDA)")
        parity = check_golden(load_engine_dir(work), Golden.load(work / "golden.npz"))
        manifest = replace(manifest, settings=replace(manifest.settings, parity=parity))
        save(manifest, work)
        return manifest
