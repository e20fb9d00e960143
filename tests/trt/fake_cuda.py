"""A recording stand-in for cuda-bindings' runtime module and a TensorRT engine / context, enough for `_TrtGraph`:
host memory is real (ctypes), device pointers are numbers, CUDA graphs are names, every call is recorded."""

from __future__ import annotations

import ctypes
import enum
from typing import Any


class _Kind(enum.IntEnum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class _Mode(enum.IntEnum):
    cudaStreamCaptureModeThreadLocal = 1


class FakeCudart:
    cudaMemcpyKind = _Kind
    cudaStreamCaptureMode = _Mode

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self._host: dict[int, Any] = {}
        self._next = 0x1000
        self.created: list[str] = []  # executable graphs, in order
        self.destroyed: list[str] = []

    def _ok(self, *values: Any) -> tuple[Any, ...]:
        return (0, *values)

    def cudaMallocHost(self, n: int) -> tuple[Any, ...]:  # noqa: N802 - CUDA's names
        buf = (ctypes.c_byte * n)()
        self._host[ctypes.addressof(buf)] = buf
        return self._ok(ctypes.addressof(buf))

    def cudaFreeHost(self, ptr: int) -> tuple[Any, ...]:  # noqa: N802
        self._host.pop(ptr, None)
        return self._ok()

    def cudaMalloc(self, n: int) -> tuple[Any, ...]:  # noqa: N802
        self._next += max(256, n)
        return self._ok(self._next)

    def cudaMemset(self, *a: Any) -> tuple[Any, ...]:  # noqa: N802
        return self._ok()

    def cudaFree(self, ptr: int) -> tuple[Any, ...]:  # noqa: N802
        return self._ok()

    def cudaMemcpyAsync(self, *a: Any) -> tuple[Any, ...]:  # noqa: N802
        self.calls.append(("memcpy",))
        return self._ok()

    def cudaStreamBeginCapture(self, stream: Any, mode: Any) -> tuple[Any, ...]:  # noqa: N802
        self.calls.append(("begin_capture",))
        return self._ok()

    def cudaStreamEndCapture(self, stream: Any) -> tuple[Any, ...]:  # noqa: N802
        self.calls.append(("end_capture",))
        return self._ok(f"graph{len(self.created)}")

    def cudaGraphInstantiate(self, graph: str, flags: int) -> tuple[Any, ...]:  # noqa: N802
        exe = f"exec{len(self.created)}"
        self.created.append(exe)
        return self._ok(exe)

    def cudaGraphDestroy(self, graph: str) -> tuple[Any, ...]:  # noqa: N802
        return self._ok()

    def cudaGraphExecDestroy(self, exe: str) -> tuple[Any, ...]:  # noqa: N802
        self.destroyed.append(exe)
        self.calls.append(("destroy", exe))
        return self._ok()

    def cudaGraphLaunch(self, exe: str, stream: Any) -> tuple[Any, ...]:  # noqa: N802
        assert exe not in self.destroyed, f"{exe} launched after it was destroyed"
        self.calls.append(("launch", exe))
        return self._ok()

    def cudaStreamSynchronize(self, stream: Any) -> tuple[Any, ...]:  # noqa: N802
        return self._ok()

    def cudaStreamDestroy(self, stream: Any) -> tuple[Any, ...]:  # noqa: N802
        self.calls.append(("stream_destroy",))
        return self._ok()


class FakeStream:
    """cuda-bindings' cudaStream_t: int() is the deprecated way to its address, getPtr() the native one."""

    def getPtr(self) -> int:  # noqa: N802
        return 0xABC

    def __int__(self) -> int:
        raise AssertionError("int(stream) is deprecated in cuda-bindings: use the native-handle helper")


class FakeContext:
    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def set_input_shape(self, name: str, shape: Any) -> bool:
        self.calls.append(("set_input_shape", name, tuple(shape)))
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        return True

    def execute_async_v3(self, handle: int) -> bool:
        assert isinstance(handle, int)
        self.calls.append(("execute", handle))
        return True


class FakeEngine:
    """An ICudaEngine over the manifest's names; `aliases` is what get_aliased_input_tensor reports (None: the
    bindings lack it)."""

    def __init__(self, inputs: list[str], outputs: list[str], profile: dict[str, Any], calls: list[tuple[Any, ...]],
                 aliases: dict[str, str] | None) -> None:
        self.inputs, self.outputs, self.profile, self.calls = inputs, outputs, profile, calls
        self.num_io_tensors = len(inputs) + len(outputs)
        if aliases is not None:
            self.get_aliased_input_tensor = lambda name: aliases.get(name)

    def get_tensor_name(self, i: int) -> str:
        return (self.inputs + self.outputs)[i]

    def get_tensor_mode(self, name: str) -> str:
        return "INPUT" if name in self.inputs else "OUTPUT"

    def get_tensor_profile_shape(self, name: str, index: int) -> Any:
        return self.profile[name]

    def create_execution_context(self) -> FakeContext:
        return FakeContext(self.calls)


class FakeTrtModule:
    TensorIOMode = type("TensorIOMode", (), {"INPUT": "INPUT", "OUTPUT": "OUTPUT"})


class FakeRuntime:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def deserialize_cuda_engine(self, data: bytes) -> FakeEngine:
        return self.engine
