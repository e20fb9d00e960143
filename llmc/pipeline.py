"""Turn what a user passes to `llmc run` into an engine folder: an engine, an export, or a model reference.

Exports and builds on first use into the cache; a model reference needs the `export` extra.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from llmc.errors import BackendUnavailableError
from llmc.manifest import ENGINE_MANIFEST, EXPORT_MANIFEST
from llmc.paths import cache_dir
from llmc.progress import Progress, Quiet


def require_export_extra() -> None:
    missing = [m for m in ("torch", "transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise BackendUnavailableError(
            f"exporting needs {', '.join(missing)}: pip install 'llmc[export]' (torch==2.13.0 for a CPU build)"
        )


def ensure_engine(ref: str, progress: Progress | None = None) -> Path:
    progress = progress or Quiet()
    path = Path(ref).expanduser()
    if (path / ENGINE_MANIFEST).is_file():
        return path
    if (path / EXPORT_MANIFEST).is_file():
        return _build_cached(path, progress)
    from llmc.export.sources import DEFAULT, is_default_name

    key = DEFAULT.name.lower() if is_default_name(ref) else path.resolve().as_posix()
    export_dir = cache_dir() / "exports" / _slug(key)
    if not (export_dir / EXPORT_MANIFEST).is_file():
        require_export_extra()
        from llmc.export.exporter import ExportConfig, export

        progress.step(f"first use of {ref}: exporting into {export_dir}")
        export(ExportConfig(ref, export_dir, force=True), progress)
    return _build_cached(export_dir, progress)


def _build_cached(export_dir: Path, progress: Progress) -> Path:
    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.manifest import sha256_file

    digest = sha256_file(export_dir / EXPORT_MANIFEST)[:12]
    engine_dir = cache_dir() / "engines" / f"{export_dir.name}-ort-{digest}"
    if not (engine_dir / ENGINE_MANIFEST).is_file():
        progress.step(f"building the ONNX Runtime engine into {engine_dir}")
        build_ort(BuildConfig(export_dir, engine_dir, force=True), progress)
    return engine_dir


def _slug(key: str) -> str:
    name = Path(key).name or "model"
    return f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
