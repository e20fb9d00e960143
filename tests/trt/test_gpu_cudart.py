"""The TensorRT engine's CUDA side on a real GPU, without TensorRT (which a GPU machine may lack: the lent H200s
could not install it): `_TrtGraph`'s pinned host buffers, device buffers, async copies on its stream, the stream
handle, and its CUDA graphs (captured after one plain run, replayed with new inputs, destroyed on close), with an
execution context whose "engine" is a device copy enqueued on the stream: the step's token ids into the logits
buffer and into the first layer's bound cache row. Then `TrtKVCache.move` on device memory.

Needs cuda-bindings and an NVIDIA GPU (scripts/gpu_check.sh runs it); skipped elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmc.engines.trt.profiles import plan_profiles
from llmc.engines.trt.run import (
    PinnedArray,
    TrtKVCache,
    _TrtGraph,
    cuda_call,
    cudart,
    gpu_info,
    stream_handle,
)
from llmc.graph import io_names as io

from .fake_cuda import FakeEngine, FakeRuntime, FakeTrtModule
from .test_profiles import MODEL
from .test_trt_calls import LIMITS, _manifest


def _gpu() -> bool:
    try:
        from cuda.bindings import runtime
    except ImportError:
        return False
    err, count = runtime.cudaGetDeviceCount()
    return int(err) == 0 and count > 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu(), reason="needs cuda-bindings and an NVIDIA GPU")]


class _DeviceContext:
    """An execution context whose run copies the bound input_ids (8 bytes a token) to the bound logits and to the
    first present tensor's bound address, on the stream it is run on."""

    def __init__(self, stream: Any, present: str) -> None:
        self.stream, self.present = stream, present
        self.addresses: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.handles: list[int] = []

    def set_input_shape(self, name: str, shape: Any) -> bool:
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def execute_async_v3(self, handle: int) -> bool:
        rt = cudart()
        self.handles.append(handle)
        nbytes = int(np.prod(self.shapes[io.INPUT_IDS])) * 8
        for dst in (self.addresses[io.LOGITS], self.addresses[self.present]):
            cuda_call(rt.cudaMemcpyAsync(dst, self.addresses[io.INPUT_IDS], nbytes,
                                         rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))
        return True


class _DeviceEngine(FakeEngine):
    def __init__(self, context: _DeviceContext, *args: Any) -> None:
        super().__init__(*args)
        self.context = context

    def create_execution_context(self) -> _DeviceContext:  # type: ignore[override]
        return self.context


def _read(address: int, count: int) -> list[int]:
    """`count` int64 at a device address."""
    rt = cudart()
    host = PinnedArray(count, np.int64)
    cuda_call(rt.cudaMemcpy(host.ptr, address, count * 8, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
    return host.array.tolist()


def test_gpu_info_names_the_gpu() -> None:
    name, capability = gpu_info()
    assert name and re.fullmatch(r"\d+\.\d+", capability), (name, capability)


def test_decode_steps_run_and_replay_cuda_graphs_on_the_gpu(tmp_path: Path) -> None:
    rt = cudart()
    stream = cuda_call(rt.cudaStreamCreate())
    assert stream_handle(stream) != 0  # a created stream, not the legacy default one
    manifest = _manifest()
    profile = plan_profiles(LIMITS, manifest.prefill, manifest.decode)["decode"]
    shapes = {name: (r.min, r.opt, r.max) for name, r in profile.inputs.items()}
    present = manifest.kv.names("present")
    context = _DeviceContext(stream, present[0])
    engine = _DeviceEngine(context, manifest.decode.input_names(), manifest.decode.output_names(), shapes, [],
                           dict(zip(present, manifest.kv.names("past"))))
    (tmp_path / "decode.plan").write_bytes(b"plan")
    rows = LIMITS.max_batch_size
    g = _TrtGraph(FakeTrtModule(), FakeRuntime(engine), tmp_path / "decode.plan", profile, manifest, stream, rows, rows)
    kv = TrtKVCache(manifest, 4, 128, LIMITS.max_seq_len)
    kv_shape = (2, MODEL.num_kv_heads, LIMITS.max_seq_len, MODEL.head_dim)
    step_shapes = {io.INPUT_IDS: (2, 1), io.POSITION_IDS: (2, 1), **{n: kv_shape for n in kv.names}}
    for step in range(4):  # a plain run, a captured one, two replays: each with new token ids
        ids = np.array([[7 + 100 * step], [8 + 100 * step]], np.int64)
        logits = g.run(kv, 1, ids, np.zeros_like(ids), 1, step_shapes)
        assert logits.ravel()[:4].view(np.int64).tolist() == ids.ravel().tolist(), step  # the replay read them anew
        assert _read(kv.address(0, 1), 2) == ids.ravel().tolist(), step  # slot 1: the binding's first row
    assert len(g.graphs) == 1 and len(context.handles) == 2  # executed plainly once, once under capture
    assert context.handles == [stream_handle(stream)] * 2
    kv.lengths[1] = 5
    kv.move(1, 3)
    assert _read(kv.address(0, 3), 2) == [307, 308] and (kv.lengths[1], kv.lengths[3]) == (0, 5)
    g.close()  # destroys the capture
    assert not g.graphs
    cuda_call(rt.cudaStreamDestroy(stream))
