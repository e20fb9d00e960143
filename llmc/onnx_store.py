"""ONNX files on disk: weights stored once in one external-data file that several graphs reference by offset,
and the safety check every loader runs."""

from __future__ import annotations

import hashlib
import mmap
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from llmc.errors import ManifestError

ALIGN = 4096  # page-aligned offsets so runtimes can memory-map each tensor


class WeightFile:
    """Appends tensors to `path` and hands out TensorProtos that point into it (no data copied into graphs)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._protos: dict[str, TensorProto] = {}
        self._placed: dict[bytes, int] = {}  # sha256 of bytes -> offset

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self._protos:
            return
        data = np.ascontiguousarray(array)
        proto = TensorProto()
        proto.name = name
        proto.data_type = helper.np_dtype_to_tensor_dtype(data.dtype)
        proto.dims.extend(data.shape)
        self.point(proto, data.reshape(-1).view(np.uint8).data)  # (its bytes as a memoryview, not a copy)
        self._protos[name] = proto

    def point(self, proto: TensorProto, raw: bytes | memoryview) -> None:
        """Make `proto` refer to `raw` in this file (bytes, or a 1-D memoryview of them), writing it only if the same
        bytes are not there yet."""
        key = hashlib.sha256(raw).digest()
        if key not in self._placed:
            offset = self._file.tell()
            pad = (-offset) % ALIGN
            self._file.write(b"\0" * pad)
            self._file.write(raw)
            self._placed[key] = offset + pad
        proto.ClearField("raw_data")
        del proto.external_data[:]
        proto.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.path.name), ("offset", str(self._placed[key])), ("length", str(len(raw)))):
            entry = proto.external_data.add()
            entry.key, entry.value = k, v

    def proto(self, name: str) -> TensorProto:
        return self._protos[name]

    def close(self) -> None:
        self._file.close()


def make_model(graph: onnx.GraphProto, weights: WeightFile | Mapping[str, TensorProto], used: list[str], opset: int,
               extra_opsets: dict[str, int] | None = None) -> onnx.ModelProto:
    """The model of `graph` with its weights `used` pointing into a weight file (one being written, or the
    initializers a written graph already points with)."""
    proto = weights.proto if isinstance(weights, WeightFile) else weights.__getitem__
    graph.initializer.extend(proto(n) for n in used)
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="llmc")
    model.ir_version = 10 if opset <= 21 else 11  # IR 10 for opset <= 21: ONNX Runtime >= 1.17, TensorRT 10
    return model


def read_external(proto: TensorProto, base_dir: Path) -> bytes:
    """The raw bytes of an initializer stored as external data."""
    info = {e.key: e.value for e in proto.external_data}
    with open(Path(base_dir) / info["location"], "rb") as f:
        f.seek(int(info.get("offset", 0)))
        return f.read(int(info["length"])) if "length" in info else f.read()


def to_numpy(proto: TensorProto, base_dir: Path) -> np.ndarray:
    """An initializer's values (its external data read from `base_dir`); damaged data is a one-line error."""
    try:
        return numpy_helper.to_array(proto, base_dir=str(base_dir))
    except Exception as e:  # onnx and numpy raise many types for short or missing data
        where = next((x.value for x in proto.external_data if x.key == "location"), "the graph")
        raise ManifestError(f"{Path(base_dir) / where}: cannot read tensor {proto.name!r} "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}); the "
                            "file is damaged: write it again with the stage that made it") from None


MAPPABLE = frozenset(np.dtype(t) for t in ("float32", "float16", "float64", "int8", "uint8", "int16", "uint16", "int32",
                                            "uint32", "int64", "uint64", "bool"))


class MappedFiles:
    """Read-only views of initializers' external data, each file mapped once (page cache: nothing copied into the
    process's own memory, and shared with every other reader of the file, ONNX Runtime's sessions included)."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = Path(base_dir)
        self._maps: dict[str, mmap.mmap] = {}

    def array(self, proto: TensorProto) -> np.ndarray:
        """The initializer's values as a read-only view of its file; a tensor that cannot be mapped as it is (inline
        data, a type numpy does not hold natively) is read as to_numpy reads it."""
        info = {e.key: e.value for e in proto.external_data}
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(proto.data_type)) if proto.data_type else None
        if proto.data_location != TensorProto.EXTERNAL or "location" not in info or dtype not in MAPPABLE:
            return to_numpy(proto, self.base_dir)
        count = int(np.prod(proto.dims, dtype=np.int64))
        offset, length = int(info.get("offset", 0)), int(info.get("length", count * dtype.itemsize))
        path = self.base_dir / info["location"]
        try:
            region = self._maps.get(info["location"]) or self._map(info["location"], path)
        except (OSError, ValueError):  # missing or empty: to_numpy's one-line error
            return to_numpy(proto, self.base_dir)
        if length != count * dtype.itemsize or offset + length > len(region):
            raise ManifestError(f"{path}: tensor {proto.name!r} needs bytes {offset} .. {offset + length} as "
                                f"{list(proto.dims)} of {dtype}, the file holds {len(region)} bytes; the file is "
                                "damaged: write it again with the stage that made it")
        return np.frombuffer(region, dtype, count, offset).reshape(tuple(proto.dims))

    def _map(self, location: str, path: Path) -> mmap.mmap:
        with open(path, "rb") as f:
            region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._maps[location] = region
        return region


def load_graph(path: Path) -> onnx.ModelProto:
    """An ONNX graph without its external data; a file that is not one (truncated, overwritten) is a one-line
    error naming it, whatever its recorded checksum says."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except FileNotFoundError:
        raise ManifestError(f"{path} is missing") from None
    except Exception as e:  # protobuf's DecodeError and friends
        detail = str(e).splitlines()[0] if str(e) else "no detail"
        raise ManifestError(f"{path} is not a readable ONNX graph ({type(e).__name__}: {detail}); the file is "
                            "damaged: write it again with the stage that made it") from None


def check_external_paths(model_path: Path, model: onnx.ModelProto | None = None) -> None:
    """Refuse external data that points outside the model's folder (a path-traversal hole in ONNX); `model`: the
    graph at model_path, where the caller has read it already."""
    model = model if model is not None else load_graph(model_path)
    root = model_path.parent.resolve()
    for init in model.graph.initializer:
        for entry in init.external_data:
            if entry.key == "location":
                target = (root / entry.value).resolve()
                if root not in target.parents:
                    raise ManifestError(
                        f"{model_path.name}: external data {entry.value!r} of {init.name} escapes {root}"
                    )
