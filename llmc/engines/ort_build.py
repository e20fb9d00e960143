"""`llmc build --backend ort`: optimize the exported graphs offline with ONNX Runtime and save the engine."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from llmc.engines.base import EngineOptions
from llmc.engines.kernels import LIBRARY, compile_library, register
from llmc.engines.ort import OrtEngine, default_threads
from llmc.engines.ort_graphs import load_checkpoint, quantized, write_inplace_graphs
from llmc.errors import EngineError, InputError
from llmc.golden import Golden
from llmc.graph.moe import with_moe_weights
from llmc.graph.quant import KERNELS, SCHEMES, TILE_BLOCK, QuantSpec
from llmc.manifest import (
    EngineManifest,
    ExportManifest,
    GraphSpec,
    KVSpec,
    load_export,
    save,
    sha256_file,
    verify_files,
)
from llmc.onnx_store import WeightFile, check_external_paths, read_external
from llmc.outdir import atomic_dir, check_out_dir
from llmc.progress import Progress, Quiet

# Files copied from the export so an engine folder runs on its own.
RUNTIME_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "golden.npz")
ENGINE_WEIGHTS = "weights.bin"
ATTENTIONS = ("gqa", "llmc", "onnx")


MOE_UNROLL_MAX = 32  # experts per layer up to which the "standard" (unrolled) mixture lowering is the default


@dataclass(frozen=True)
class BuildConfig:
    export_dir: Path
    out_dir: Path
    backend: str = "ort"
    quant: str = "none"  # none | int8 | int4
    threads: int = 0
    force: bool = False
    kv_layout: str = "inplace"  # inplace (one shared past/present buffer) | concat (the export's own graphs)
    attention: str = "gqa"  # inplace lowering: gqa (GroupQueryAttention) | llmc (llmc's operator) | onnx
    kv_dtype: str = ""  # the KV cache's dtype: "" = the export's; "float16" or "int8" (llmc attention, fp32 exports)
    block_size: int = 32
    accuracy_level: int = 4
    quant_scheme: str = "auto"
    matmul: str = "ort"  # --quant int4: ort (MatMulNBits) | llmc (llmc's MatMulQ4)
    moe: str = "auto"  # mixture-of-experts lowering: auto | ort (com.microsoft.MoE) | standard (per-expert MatMuls)

    def moe_lowering(self, num_experts: int) -> str:
        """"auto": per-expert MatMuls (multithreaded by ONNX Runtime: measured 1.21x / 1.51x com.microsoft.MoE's
        decode at batch 1 / 8 with 8 experts) up to MOE_UNROLL_MAX experts, the MoE op beyond (fewer nodes)."""
        if self.moe != "auto":
            return self.moe
        return "standard" if num_experts <= MOE_UNROLL_MAX else "ort"

    def quant_spec(self) -> QuantSpec | None:
        if self.quant == "none":
            return None
        return QuantSpec(bits=int(self.quant.removeprefix("int")), block_size=self.block_size,
                         accuracy_level=self.accuracy_level, scheme=self.quant_scheme, kernel=self.matmul)

    def uses_llmc_ops(self) -> bool:
        """Whether the engine's graphs hold llmc's own operators (compiled into the engine folder)."""
        return self.kv_layout == "inplace" and (self.attention == "llmc" or self.matmul == "llmc")


def engine_manifest(export: ExportManifest, export_dir: Path, backend: str, precision: str,
                    settings: dict[str, object], files: dict[str, str],
                    graphs: tuple[GraphSpec, GraphSpec] | None = None, kv: KVSpec | None = None) -> EngineManifest:
    prefill, decode = graphs or (export.prefill, export.decode)
    return EngineManifest(
        backend=backend, precision=precision, export_dir=str(Path(export_dir).resolve()),
        export_manifest_sha256=sha256_file(Path(export_dir) / "llmc.json") if (Path(export_dir) / "llmc.json").exists()
        else "", model_name=export.model_name, model=export.model, kv=kv or export.kv, prefill=prefill, decode=decode,
        generation=export.generation, settings=dict(settings), tools=dict(export.tools), files=files,
    )


def export_engine(export: ExportManifest, export_dir: Path, threads: int = 0) -> OrtEngine:
    """An engine straight over the exported graphs (used to check an export before it is complete)."""
    manifest = engine_manifest(export, export_dir, "ort", export.dtype, {"threads": threads}, files={})
    return OrtEngine(manifest, export_dir, EngineOptions(threads=threads))


def check_build_config(cfg: BuildConfig) -> None:
    if cfg.quant not in ("none", "int8", "int4"):
        raise InputError(f"--quant must be none, int8 or int4, got {cfg.quant!r}")
    if cfg.attention not in ATTENTIONS:
        raise InputError(f"--attention must be one of {', '.join(ATTENTIONS)}, got {cfg.attention!r}")
    if cfg.kv_dtype not in ("", "float32", "float16", "int8"):
        raise InputError(f"--kv-dtype must be float32, float16 or int8, got {cfg.kv_dtype!r}")
    if cfg.kv_dtype in ("float16", "int8") and cfg.attention != "llmc":
        raise InputError(f"--kv-dtype {cfg.kv_dtype} needs --attention llmc (got --attention {cfg.attention})")
    if cfg.kv_layout not in ("inplace", "concat"):
        raise InputError(f"--kv-layout must be inplace or concat, got {cfg.kv_layout!r}")
    if cfg.quant != "none" and cfg.kv_layout == "concat":
        raise InputError("--quant needs --kv-layout inplace (the concat layout runs the export's graphs as they are)")
    if cfg.block_size not in (16, 32, 64, 128, 256):
        raise InputError(f"--block-size must be one of 16, 32, 64, 128, 256, got {cfg.block_size}")
    if cfg.quant_scheme not in SCHEMES:
        raise InputError(f"--quant-scheme must be one of {', '.join(SCHEMES)}, got {cfg.quant_scheme!r}")
    if cfg.moe not in ("auto", "ort", "standard"):
        raise InputError(f"--moe must be auto, ort or standard, got {cfg.moe!r}")
    if cfg.matmul not in KERNELS:
        raise InputError(f"--matmul must be one of {', '.join(KERNELS)}, got {cfg.matmul!r}")
    if cfg.matmul == "llmc" and cfg.quant != "int4":
        raise InputError(f"--matmul llmc is a 4-bit kernel: it needs --quant int4 (got --quant {cfg.quant})")
    if cfg.matmul == "llmc" and cfg.block_size != TILE_BLOCK:
        raise InputError(f"--matmul llmc works in blocks of {TILE_BLOCK}, got --block-size {cfg.block_size}")
    if cfg.accuracy_level not in (0, 1, 2, 3, 4):
        raise InputError(f"--accuracy-level must be in [0, 4], got {cfg.accuracy_level}")
    if cfg.threads < 0:
        raise InputError(f"--threads must be >= 0 (0 = physical cores), got {cfg.threads}")
    check_out_dir(cfg.out_dir, cfg.force)


def build_ort(cfg: BuildConfig, progress: Progress | None = None) -> EngineManifest:
    progress = progress or Quiet()
    check_build_config(cfg)
    export_dir = Path(cfg.export_dir)
    export = load_export(export_dir)
    progress.step(f"checking export {export_dir} ({export.model_name}, {export.dtype})")
    verify_files(export_dir, export.files)
    for spec in (export.prefill, export.decode):  # before ONNX Runtime or onnx follow any external-data path
        check_external_paths(export_dir / spec.file)
    with atomic_dir(cfg.out_dir, export_dir, "export") as work:
        return _build_into(work, export_dir, export, cfg, progress)


def _build_into(work: Path, export_dir: Path, export: ExportManifest, cfg: BuildConfig,
                progress: Progress) -> EngineManifest:
    import onnxruntime as ort

    threads = cfg.threads or default_threads()
    scratch = work / "scratch"
    scratch.mkdir()
    src_dir, kv, graphs = export_dir, export.kv, (export.prefill, export.decode)
    custom_ops = cfg.uses_llmc_ops()
    if cfg.kv_dtype not in ("", export.dtype) and not (cfg.kv_layout == "inplace" and cfg.attention == "llmc"):
        raise InputError(f"--kv-dtype {cfg.kv_dtype} differs from the export's {export.dtype}: only "
                         "--attention llmc (in place) takes another cache dtype")
    if custom_ops:
        wanted_by = "--attention llmc" if cfg.attention == "llmc" else "--matmul llmc"
        if export.dtype != "float32":
            raise InputError(f"{wanted_by} computes in float32 and the export is {export.dtype}; "
                             "leave it out for this export")
        progress.step("compiling llmc's operators")
        compile_library(work, wanted_by)
    if cfg.kv_layout == "inplace":
        progress.step(f"lowering attention to {cfg.attention} with an in-place KV cache (weights: {cfg.quant})")
        moe = cfg.moe_lowering(export.model.num_experts)
        ckpt = with_moe_weights(load_checkpoint(export_dir, export), moe)  # before quantizing: experts' weights too
        quant = cfg.quant_spec()
        if quant is not None:
            ckpt = quantized(ckpt, quant)
        src_dir = scratch / "lowered"
        src_dir.mkdir()
        kv, *lowered = write_inplace_graphs(ckpt, src_dir, export.dtype, export.opset, quant, cfg.attention,
                                            fuse_norms=True, one_graph=True, kv_dtype=cfg.kv_dtype or None,
                                            moe=moe)
        graphs = (lowered[0], lowered[1])
    progress.step("optimizing graphs with ONNX Runtime (offline, saved)")
    graph_files = list(dict.fromkeys(g.file for g in graphs))  # in-place engines: one graph for both
    for file in graph_files:
        _optimize(src_dir / file, scratch / file, threads, work if custom_ops else None)
    progress.step("storing the optimized weights once")
    _share_weights(scratch, work, graph_files)
    shutil.rmtree(scratch)
    for name in RUNTIME_FILES:
        if (export_dir / name).is_file():
            shutil.copy2(export_dir / name, work / name)
    files = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file()}
    settings: dict[str, object] = {"threads": threads, "optimization": "extended", "quant": cfg.quant, "kv_layout": kv.layout,
                "attention": cfg.attention if kv.layout == "inplace" else "decomposed",
                "block_size": cfg.block_size, "accuracy_level": cfg.accuracy_level, "matmul": cfg.matmul,
                "onnxruntime": ort.__version__}
    if custom_ops:
        settings["custom_ops"] = LIBRARY
    precision = export.dtype if cfg.quant == "none" else f"{cfg.quant}-{export.dtype}"
    manifest = engine_manifest(export, export_dir, "ort", precision, settings, files, graphs, kv)
    progress.step("checking the engine against the golden outputs")
    from llmc.engines.registry import load_engine_dir
    from llmc.runtime.verify import check_golden

    save(manifest, work)
    parity = check_golden(load_engine_dir(work, EngineOptions(threads=threads)), Golden.load(work / "golden.npz"))
    manifest = replace(manifest, settings={**settings, "parity": parity})
    save(manifest, work)
    return manifest


def _optimize(src: Path, dst: Path, threads: int, custom_ops_dir: Path | None) -> None:
    import onnxruntime as ort

    so = ort.SessionOptions()
    if custom_ops_dir is not None:
        register(so, custom_ops_dir)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(dst)
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.stem + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own exception types: report one line
        raise EngineError(f"onnxruntime could not optimize {src.name}: {str(e).splitlines()[0]}") from e


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
