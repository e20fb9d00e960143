"""`llmc build --backend trt`: TensorRT engines (needs the `trt` extra and an NVIDIA GPU)."""

from __future__ import annotations

import importlib.util

from llmc.engines.ort_build import BuildConfig
from llmc.errors import BackendUnavailableError, LlmcError
from llmc.manifest import EngineManifest
from llmc.progress import Progress


def require_tensorrt() -> None:
    if importlib.util.find_spec("tensorrt") is None:
        raise BackendUnavailableError(
            "TensorRT is not installed: --backend trt needs an NVIDIA GPU and pip install 'llmc[trt]'; "
            "use --backend ort on this machine"
        )


def build_trt(cfg: BuildConfig, progress: Progress | None = None) -> EngineManifest:
    require_tensorrt()
    raise LlmcError("TensorRT engine building is not part of this llmc version yet; use --backend ort")
