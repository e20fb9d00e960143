"""Backends are found by name here, not by `if backend == ...` branches in the runtime."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmc.engines.base import Engine, EngineOptions
from llmc.errors import InputError
from llmc.manifest import EngineManifest, load_engine

Loader = Callable[[EngineManifest, Path, EngineOptions], Engine]


def _ort(manifest: EngineManifest, directory: Path, options: EngineOptions) -> Engine:
    if manifest.kv.layout == "inplace":
        from llmc.engines.ort.inplace import OrtInplaceEngine

        return OrtInplaceEngine(manifest, directory, options)
    from llmc.engines.ort.run import OrtEngine

    return OrtEngine(manifest, directory, options)


def _trt(manifest: EngineManifest, directory: Path, options: EngineOptions) -> Engine:
    from llmc.engines.trt.run import TrtEngine

    return TrtEngine(manifest, directory, options)


def _ort_cuda(manifest: EngineManifest, directory: Path, options: EngineOptions) -> Engine:
    from llmc.engines.ort.cuda import OrtCudaEngine

    return OrtCudaEngine(manifest, directory, options)


LOADERS: dict[str, Loader] = {"ort": _ort, "trt": _trt, "ort-cuda": _ort_cuda}


def load_engine_dir(directory: Path | str, options: EngineOptions | None = None) -> Engine:
    directory = Path(directory)
    manifest = load_engine(directory)
    loader = LOADERS.get(manifest.backend)
    if loader is None:
        raise InputError(f"engine backend {manifest.backend!r} is unknown; known: {', '.join(LOADERS)}")
    return loader(manifest, directory, options or EngineOptions())
