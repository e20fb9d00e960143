"""Dispatch `llmc build` to the backend's builder (found by name, like engine loaders)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmc.engines.ort.build import BuildConfig, build_ort
from llmc.errors import BackendUnavailableError, InputError
from llmc.manifest import EngineManifest
from llmc.progress import Progress

if TYPE_CHECKING:
    from llmc.engines.trt.build import TrtBuildConfig

__all__ = ["BuildConfig", "build"]


def _trt(cfg: BuildConfig | TrtBuildConfig, progress: Progress | None) -> EngineManifest:
    try:
        from llmc.engines.trt.build import build_trt
    except ImportError as e:
        raise BackendUnavailableError(f"the trt backend is unavailable: {e}") from None
    return build_trt(cfg, progress)


def _ort_cuda(cfg: BuildConfig, progress: Progress | None) -> EngineManifest:
    from llmc.engines.ort.cuda import build_ort_cuda

    return build_ort_cuda(cfg, progress)


BUILDERS: dict[str, Any] = {"ort": build_ort, "trt": _trt, "ort-cuda": _ort_cuda}


def build(cfg: BuildConfig | TrtBuildConfig, progress: Progress | None = None) -> EngineManifest:
    builder = BUILDERS.get(cfg.backend)
    if builder is None:
        raise InputError(f"--backend {cfg.backend!r} is unknown; known: {', '.join(BUILDERS)}")
    return builder(cfg, progress)
