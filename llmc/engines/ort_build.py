"""`llmc build --backend ort`: optimize the exported graphs offline with ONNX Runtime and save the engine."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from llmc.engines.base import EngineOptions
from llmc.engines.ort import OrtEngine, default_threads
from llmc.errors import InputError
from llmc.golden import Golden
from llmc.manifest import (
    EngineManifest,
    ExportManifest,
    GraphSpec,
    load_export,
    save,
    sha256_file,
    verify_files,
)
from llmc.onnx_store import WeightFile, read_external
from llmc.progress import Progress, Quiet

# Files copied from the export so an engine folder runs on its own.
RUNTIME_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "golden.npz")
ENGINE_WEIGHTS = "weights.bin"


@dataclass(frozen=True)
class BuildConfig:
    export_dir: Path
    out_dir: Path
    backend: str = "ort"
    quant: str = "none"
    threads: int = 0
    force: bool = False


def engine_manifest(export: ExportManifest, export_dir: Path, backend: str, precision: str,
                    settings: dict[str, object], files: dict[str, str],
                    graphs: tuple[GraphSpec, GraphSpec] | None = None) -> EngineManifest:
    prefill, decode = graphs or (export.prefill, export.decode)
    return EngineManifest(
        backend=backend, precision=precision, export_dir=str(Path(export_dir).resolve()),
        export_manifest_sha256=sha256_file(Path(export_dir) / "llmc.json") if (Path(export_dir) / "llmc.json").exists()
        else "", model_name=export.model_name, model=export.model, kv=export.kv, prefill=prefill, decode=decode,
        generation=export.generation, settings=dict(settings), tools=dict(export.tools), files=files,
    )


def export_engine(export: ExportManifest, export_dir: Path, threads: int = 0) -> OrtEngine:
    """An engine straight over the exported graphs (used to check an export before it is complete)."""
    manifest = engine_manifest(export, export_dir, "ort", export.dtype, {"threads": threads}, files={})
    return OrtEngine(manifest, export_dir, EngineOptions(threads=threads))


def check_build_config(cfg: BuildConfig) -> None:
    if cfg.quant != "none":
        raise InputError(f"--quant {cfg.quant} is not available in this version of the ort backend; use none")
    if cfg.threads < 0:
        raise InputError(f"--threads must be >= 0 (0 = physical cores), got {cfg.threads}")
    out = Path(cfg.out_dir)
    if out.is_dir() and any(out.iterdir()) and not cfg.force:
        raise InputError(f"output directory {out} is not empty; pass --force to overwrite it")


def build_ort(cfg: BuildConfig, progress: Progress | None = None) -> EngineManifest:
    progress = progress or Quiet()
    check_build_config(cfg)
    export_dir = Path(cfg.export_dir)
    export = load_export(export_dir)
    progress.step(f"checking export {export_dir} ({export.model_name}, {export.dtype})")
    verify_files(export_dir, export.files)
    out = Path(cfg.out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        manifest = _build_into(work, export_dir, export, cfg, progress)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
        return replace(manifest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _build_into(work: Path, export_dir: Path, export: ExportManifest, cfg: BuildConfig,
                progress: Progress) -> EngineManifest:
    import onnxruntime as ort

    threads = cfg.threads or default_threads()
    progress.step("optimizing graphs with ONNX Runtime (offline, saved)")
    scratch = work / "scratch"
    scratch.mkdir()
    for spec in (export.prefill, export.decode):
        _optimize(export_dir / spec.file, scratch / spec.file, threads)
    progress.step("storing the optimized weights once")
    _share_weights(scratch, work, [export.prefill.file, export.decode.file])
    shutil.rmtree(scratch)
    for name in RUNTIME_FILES:
        if (export_dir / name).is_file():
            shutil.copy2(export_dir / name, work / name)
    files = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file()}
    settings = {"threads": threads, "optimization": "extended", "quant": cfg.quant,
                "onnxruntime": ort.__version__}
    manifest = engine_manifest(export, export_dir, "ort", export.dtype, settings, files)
    progress.step("checking the engine against the golden outputs")
    from llmc.runtime.verify import check_golden

    parity = check_golden(OrtEngine(manifest, work, EngineOptions(threads=threads)), Golden.load(work / "golden.npz"))
    manifest = replace(manifest, settings={**settings, "parity": parity})
    save(manifest, work)
    return manifest


def _optimize(src: Path, dst: Path, threads: int) -> None:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(dst)
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.stem + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])


def _share_weights(scratch: Path, out: Path, files: list[str]) -> None:
    """Rewrite each optimized graph to point into one weights file, each distinct tensor written once."""
    weights = WeightFile(out / ENGINE_WEIGHTS)
    try:
        for file in files:
            model = onnx.load(str(scratch / file), load_external_data=False)
            for init in model.graph.initializer:
                if init.data_location == onnx.TensorProto.EXTERNAL:
                    weights.point(init, read_external(init, scratch))
            onnx.save(model, str(out / file))
    finally:
        weights.close()
