"""The weights llmc's own operators stream (MatMulQ4, MatMulQ8, MatMulQ2, MatMulBF16), held by llmc in 2 MB pages.

Left to itself, ONNX Runtime maps an engine's weights.bin or copies its tensors into its heap, in 4 KB pages either
way. A decode step streams every weight once: ~100 MB for SmolLM2's int4 engine, a new page every 4 KB, and each
page's translation missing the TLB. Here the operators' weights are read once from weights.bin into one anonymous
mapping that the kernel is asked to back with transparent huge pages (madvise MADV_HUGEPAGE: this machine's
default, "madvise", grants them only so), and each tensor goes to ONNX Runtime with SessionOptions.add_initializer,
which uses the memory as it is (add_external_initializers copies it, into 4 KB pages again).

Measured on the Intel Xeon VM (2026-12-03): one thread's 4-bit product streaming 300 MB of weights 13.5 -> 16.0
GB/s; SmolLM2's default int4 engine, alternating processes, decode step at batch 1 ~4.95 -> ~4.5 ms and at batch
8 ~13.35 -> ~12.6 ms; the process's resident memory unchanged (the tensors are held once, in place of ONNX
Runtime's copy). Graphs that share weights.bin (an engine's prefill and decode graphs) share the tensors.

LLMC_HUGE_PAGES=0 leaves the weights to ONNX Runtime (the A/B of the figures above); the results are the same bits
either way.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
from onnx import helper

from llmc.errors import ManifestError
from llmc.graph.quant import TILE_OPS
from llmc.onnx_store import MappedFiles, load_graph

STREAMED_OPS = (*TILE_OPS.values(), "MatMulBF16")
DOMAIN = "ai.llmc"
ALIGN = 64


def enabled() -> bool:
    return os.environ.get("LLMC_HUGE_PAGES", "1") != "0"


def _arena(nbytes: int) -> tuple[Any, np.ndarray]:
    """nbytes of zeroed private anonymous memory, huge pages asked for where the OS has them."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if not flags:  # (not a POSIX system: plain memory)
        array = np.zeros(nbytes, np.uint8)
        return array, array
    region = mmap.mmap(-1, nbytes, flags=flags)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # a kernel built without transparent huge pages: 4 KB pages, the same results
            pass
    return region, np.frombuffer(region, np.uint8)


class StreamedWeights:
    """The streamed tensors of an engine's graphs, keyed by where weights.bin holds them; kept alive with the
    engine (ONNX Runtime reads them in place for the sessions' lifetime)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int, int], Any] = {}  # (file, offset, length) -> OrtValue
        self._memory: list[Any] = []  # the arenas and their arrays

    @property
    def nbytes(self) -> int:
        return sum(length for (_, _, length) in self._held)

    def add_to(self, session_options: Any, graph_path: Path) -> int:
        """Give `session_options` this graph's streamed initializers (read on first sight); returns their count."""
        model = load_graph(graph_path)
        inits = {i.name: i for i in model.graph.initializer}
        names = list(dict.fromkeys(
            name for node in model.graph.node if node.domain == DOMAIN and node.op_type in STREAMED_OPS
            for name in node.input[1:] if name in inits))
        placed: list[tuple[str, tuple[str, int, int]]] = []
        todo: dict[tuple[str, int, int], Any] = {}
        for name in names:
            proto = inits[name]
            info = {e.key: e.value for e in proto.external_data}
            if proto.data_location != proto.EXTERNAL or "length" not in info:
                continue  # (inline data: ONNX Runtime's own copy)
            key = (str((graph_path.parent / info["location"]).resolve()), int(info.get("offset", 0)),
                   int(info["length"]))
            placed.append((name, key))
            if key not in self._held:
                todo[key] = proto
        if todo:
            self._load(todo)
        for name, key in placed:
            session_options.add_initializer(name, self._held[key])
        return len(placed)

    def _load(self, todo: dict[tuple[str, int, int], Any]) -> None:
        offsets, total = {}, 0
        for key in todo:
            offsets[key] = total
            total += -(-key[2] // ALIGN) * ALIGN
        region, buf = _arena(total)
        self._memory += [region, buf]
        files: dict[str, Any] = {}
        try:
            for key, proto in todo.items():
                file, offset, length = key
                f = files.get(file) or files.setdefault(file, open(file, "rb"))
                f.seek(offset)
                view = buf[offsets[key]:offsets[key] + length]
                if f.readinto(view.data) != length:
                    raise ManifestError(f"{file}: tensor {proto.name!r} needs bytes {offset} .. {offset + length}, "
                                        f"past the file's end ({os.path.getsize(file)} bytes); the file is damaged: "
                                        "write the engine again with llmc build")
                itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(proto.data_type)).itemsize
                if itemsize not in (1, 2, 4, 8) or length != itemsize * int(np.prod(proto.dims, dtype=np.int64)):
                    raise ManifestError(f"{file}: tensor {proto.name!r} holds {length} bytes, not its shape "
                                        f"{list(proto.dims)} of {itemsize}-byte values; the graph and its weights "
                                        "disagree: write the engine again with llmc build")
                array = view.view(np.dtype(f"u{itemsize}")).reshape(tuple(proto.dims))
                self._memory.append(array)
                self._held[key] = ort_value(array, proto.data_type)
        finally:
            for f in files.values():
                f.close()


class MappedWeights:
    """An engine's weights as its folder's files map them, one mapping for all its sessions, each tensor given to
    ONNX Runtime as it lies there (SessionOptions.add_initializer): the weights of an engine that prepacks nothing
    (OrtEngineBase.prepack False). Left to itself, ONNX Runtime maps the file once a session, and the process's
    resident memory counts each mapping's pages: the export's reference engine of a 1.5 B-parameter fp32 model 12.2
    GB resident that way, 6.2 GB so (its weights once; measured)."""

    def __init__(self, directory: Path) -> None:
        self._files = MappedFiles(directory)
        self._held: dict[tuple[str, int, int], Any] = {}  # (file, offset, length) -> OrtValue over the mapping

    def add_to(self, session_options: Any, graph: Any) -> None:
        for proto in graph.graph.initializer:
            info = {e.key: e.value for e in proto.external_data}
            if proto.data_location != proto.EXTERNAL or "location" not in info:
                continue
            key = (info["location"], int(info.get("offset", 0)), int(info.get("length", -1)))
            if key not in self._held:
                self._held[key] = ort_value(self._files.array(proto), proto.data_type)
            session_options.add_initializer(proto.name, self._held[key])


def ort_value(array: np.ndarray, data_type: int) -> Any:
    """An OrtValue over `array`'s own memory (no copy), typed as the graph's initializer (data_type: an ONNX
    TensorProto type, whatever numpy dtype holds its bytes: a bf16 tensor's, say)."""
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.dtype(f"u{array.dtype.itemsize}")), data_type)
