"""`llmc build --backend ort`: optimize the exported graphs offline with ONNX Runtime and save the engine."""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import onnx

from llmc.engines.base import EngineOptions
from llmc.engines.choices import KVLayout, MatMul, MoELowering, Quant
from llmc.engines.kernels import library_path, ops_version, register
from llmc.engines.ort.config import BuildConfig, check_build_config, conservative, resolve
from llmc.engines.ort.graphs import (
    bf16_weights,
    load_checkpoint,
    quantizable,
    quantized,
    with_compact_embedding,
    with_head_parts,
    write_inplace_graphs,
)
from llmc.engines.ort.run import OrtEngine, default_threads
from llmc.errors import EngineError, InputError
from llmc.golden import GOLDEN_STEPS, Golden
from llmc.graph.moe import with_moe_weights
from llmc.manifest import (
    EngineManifest,
    EngineSettings,
    ExportManifest,
    GraphSpec,
    KVSpec,
    load_export,
    save,
    sha256_file,
    verify_files,
)
from llmc.onnx_store import WeightFile, check_external_paths, read_external
from llmc.outdir import atomic_dir
from llmc.progress import Progress, Quiet

# Files copied from the export so an engine folder runs on its own.
RUNTIME_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "golden.npz")
ENGINE_WEIGHTS = "weights.bin"
MAX_QUALITY_BUILDS = 5  # engines a quality target may build and measure in its search
QUALITY_STEP = 1.2  # short of the target, the next build raises this many times the layers ...
QUALITY_FLOOR = 1 / 8  # ... and at least this share of the candidates more


def next_raise(short: int, reached: int | None, candidates: int, builds_left: int) -> int | None:
    """The layers the next quality build raises, or None when the search is done. `short`: the most layers raised
    in a build short of the target (-1: none yet); `reached`: the fewest raised in one that reached it (None: none
    yet); `builds_left`: the builds the search may still make.

    Until a build reaches the target: QUALITY_STEP times as many (and at least QUALITY_FLOOR of the candidates
    more), every candidate in the last build allowed. A near miss (the calibration predicts well) costs a few more
    layers, not half again as many: each raised layer's 16-bit activations cost decode time wherever the dot
    products, not the bytes, bound a step (SmolLM2 int4: 90 -> 135 layers raised all 121, batch 1 0.76-0.81x the
    all-int4 engine; 90 -> 108 kept 0.94-1.05x at top-1 99.6 %). The floor is for layouts predicted small: SmolLM2 at
    --quality-target 0.98 was predicted 0 layers, which met the top-1 target but not the golden gate, and one more
    layer a build took every build up to the last, which raised all 121. Once a build has reached the target
    after one fell short: halfway between the two while builds are left, so the search ends at the fewest raised
    layers it measured to reach it. A first build that reaches the target ends the search."""
    if reached is None:
        if short >= candidates:
            return None
        if builds_left <= 1:
            return candidates if builds_left == 1 else None
        return min(candidates, max(short + 1, math.ceil(QUALITY_STEP * short),
                                   short + math.ceil(QUALITY_FLOOR * candidates)))
    if short < 0 or reached - short <= 1 or builds_left < 1:
        return None
    return (short + reached) // 2


def engine_manifest(export: ExportManifest, export_dir: Path, backend: str, precision: str,
                    settings: EngineSettings, files: dict[str, str],
                    graphs: tuple[GraphSpec, GraphSpec] | None = None, kv: KVSpec | None = None) -> EngineManifest:
    prefill, decode = graphs or (export.prefill, export.decode)
    return EngineManifest(
        backend=backend, precision=precision, export_dir=str(Path(export_dir).resolve()),
        export_manifest_sha256=sha256_file(Path(export_dir) / "llmc.json") if (Path(export_dir) / "llmc.json").exists()
        else "", model_name=export.model_name, model=export.model, kv=kv or export.kv, prefill=prefill, decode=decode,
        generation=export.generation, settings=settings, tools=dict(export.tools), files=files,
    )


class ExportEngine(OrtEngine):
    """The exported graphs as an engine: the reference that exports, builds and llmc verify check against, not one
    to serve. Past PREPACK_MAX_BYTES of weights its float products run on the weights as the file maps them
    (OrtEngineBase.prepack False): it then holds no copy of the model of its own, beside the transformers model an
    export checks or the engines a build makes. Smaller, its sessions prepack as a served engine's do: faster, and
    ONNX Runtime's packed product is the closer to transformers on one row (a tiny model's export check 5.9e-5
    against 1.2e-4 unpacked, measured)."""

    PREPACK_MAX_BYTES = 1 << 30

    def __init__(self, manifest: EngineManifest, directory: Path, options: EngineOptions, weight_bytes: int) -> None:
        self.prepack = weight_bytes <= self.PREPACK_MAX_BYTES
        super().__init__(manifest, directory, options)


def export_engine(export: ExportManifest, export_dir: Path, threads: int = 0) -> OrtEngine:
    """An engine straight over the exported graphs (used to check an export before it is complete)."""
    manifest = engine_manifest(export, export_dir, "ort", export.dtype, EngineSettings(threads=threads), files={})
    weights = Path(export_dir) / export.weights_file
    return ExportEngine(manifest, export_dir, EngineOptions(threads=threads),
                        weights.stat().st_size if weights.is_file() else 0)


def build_ort(cfg: BuildConfig, progress: Progress | None = None) -> EngineManifest:
    """Build the engine `cfg` asks for, its `auto` choices resolved for this export and CPU. The engine must
    reproduce the golden prompt's greedy continuation (unless `allow_divergence`); when the choices llmc made
    itself fail that, the engine is built again with ONNX Runtime's own operators."""
    progress = progress or Quiet()
    check_build_config(cfg)
    export_dir = Path(cfg.export_dir)
    export = load_export(export_dir)
    progress.step(f"checking export {export_dir} ({export.model_name}, {export.dtype})")
    verify_files(export_dir, export.files)
    for spec in (export.prefill, export.decode):  # before ONNX Runtime or onnx follow any external-data path
        check_external_paths(export_dir / spec.file)
    resolved = resolve(cfg, export)
    with atomic_dir(cfg.out_dir, export_dir, "export") as work:
        manifest = _build_checked(work, export_dir, export, resolved, progress)
        divergence = _divergence(manifest, work)
        fallback = _fallback(cfg, export) if divergence and resolved.uses_llmc_ops() else None
        if divergence and not cfg.allow_divergence and fallback is not None and fallback != resolved:
            progress.step(f"{divergence}; building with ONNX Runtime's operators instead")
            manifest = _build_checked(work, export_dir, export, fallback, progress)
            divergence = _divergence(manifest, work)
        if divergence and not cfg.allow_divergence:
            raise EngineError(f"{divergence}: the engine would answer differently from the model; build with "
                              "--allow-divergence to keep it, or with a higher precision")
        return manifest


def _fallback(cfg: BuildConfig, export: ExportManifest) -> BuildConfig | None:
    """What `cfg` resolves to with ONNX Runtime's operators in place of llmc's `auto` picks, or None where those
    cannot build it (an int8 cache, say, is llmc's attention's alone)."""
    try:
        return resolve(conservative(cfg), export)
    except InputError:
        return None


def _build_checked(work: Path, export_dir: Path, export: ExportManifest, cfg: BuildConfig,
                   progress: Progress) -> EngineManifest:
    """The engine in `work` (emptied first): with --quant and a quality target, at the layer precisions chosen by
    measurement (the most sensitive layers raised until llmc verify's top-1 agreement reaches the target and,
    unless divergence is allowed, the golden prompt's greedy continuation is the model's); else as configured."""
    _clear(work)
    if cfg.quant is Quant.none or cfg.quality_target <= 0 or cfg.layout:
        return _build_into(work, export_dir, export, cfg, progress)
    from llmc.engines.ort.quality import CALIBRATION_PROMPTS, PrecisionSearch, continuations, gains_nothing
    from llmc.engines.registry import load_engine_dir
    from llmc.runtime.tokenizer import Tokenizer
    from llmc.runtime.verify import VERIFY_PROMPTS, compare_to, encode_prompt, reference_traces

    threads = cfg.threads or default_threads()
    progress.step("tracing the model's greedy answers to the calibration and verify prompts (the fp32 export)")
    tok = Tokenizer.from_dir(export_dir)
    verify_prompts = [encode_prompt(tok, p) for p in VERIFY_PROMPTS]
    reference = export_engine(export, export_dir, threads)
    sequences = continuations(reference, [encode_prompt(tok, p) for p in CALIBRATION_PROMPTS])
    refs = reference_traces(reference, verify_prompts)
    del reference  # (traced once: no session of the float model beside the calibration graph and the builds)
    progress.step(f"measuring each linear layer's sensitivity to {cfg.quant.value} (calibration prompts)")
    ckpt = with_moe_weights(load_checkpoint(export_dir, export), cfg.moe.value)
    spec = cfg.quant_spec()
    assert spec is not None
    names = [n.removesuffix(".weight") for n in quantizable(ckpt) if not gains_nothing(ckpt, n)] + ["lm_head"]
    library = library_path() if cfg.uses_llmc_ops() else None
    search = PrecisionSearch(ckpt, names, spec, sequences, library, threads, cfg.quality_bytes, cfg.moe.value,
                             scratch=work, progress=progress)
    del ckpt  # (the float weights: the builds below read the export themselves)
    target = cfg.quality_target

    def measured(k: int) -> tuple[EngineManifest, dict[str, float], str | None]:
        """The engine with the k most sensitive layers raised, its llmc verify report, and why it falls short of the
        target (None: it does not)."""
        _clear(work)
        manifest = _build_into(work, export_dir, export, replace(cfg, layout=search.layout(k)), progress)
        report = compare_to(refs, load_engine_dir(work, EngineOptions(threads=threads)), verify_prompts)
        if report["top1_agreement"] < target:
            return manifest, report, f"below {target:.1%}"
        # the golden gate is part of the target: a layout that meets the top-1 agreement but leaves the model's
        # greedy answer to the golden prompt is short of it too (else the build would fail at the gate, or fall back
        # to ONNX Runtime's operators, whose int8 activations are no closer)
        return manifest, report, None if cfg.allow_divergence else _divergence(manifest, work)

    k, short, reached = search.first_k(target), -1, None
    search.release()  # (a 1B-parameter model's calibration graph and a build beside it passed 23 GB)
    for builds in range(1, MAX_QUALITY_BUILDS + 1):
        manifest, report, why = measured(k)
        if why is None:
            reached = k
        else:
            short = max(short, k)
        step = next_raise(short, reached, len(search.order), MAX_QUALITY_BUILDS - builds)
        said = f"top-1 {report['top1_agreement']:.1%} with {k} layers raised: {why or f'reaches {target:.1%}'}"
        if step is not None:
            progress.step(f"{said}; {'raising more' if why else 'trying fewer'}")
            k = step
            continue
        if why:  # (a build that reaches the target and ends the search says nothing more)
            progress.step(f"{said}; " + (f"keeping the {reached} layers that reached it" if reached is not None
                                         else "every candidate raised"))
        break
    if reached is not None and reached != k:  # the last build fell short: the fewest layers that reached it, again
        k = reached
        manifest, report, _ = measured(k)
    from llmc.bench.limits import weight_bytes_per_step

    layout = search.layout(k)
    bytes_now = weight_bytes_per_step(work, manifest)
    quality = {"target": target, "max_bytes_ratio": cfg.quality_bytes, "raised": dict(layout), "candidates": len(names), **report,
               "weight_bytes_per_step": bytes_now,
               "base_weight_bytes_per_step": bytes_now - search.extra_bytes(k),
               "sensitivity": {s.name: round(s.kl, 8) for s in search.sensitivities}}
    manifest = replace(manifest, settings=replace(manifest.settings, quality=quality))
    save(manifest, work)
    return manifest


def _clear(folder: Path) -> None:
    for child in list(folder.iterdir()):
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def _divergence(manifest: EngineManifest, work: Path) -> str | None:
    """Where the engine's greedy continuation of the golden prompt leaves the model's, in words (None: it does not)."""
    parity = manifest.settings.parity
    if "diverged_at" not in parity:
        return None
    from llmc.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(work)
    mine, theirs = int(parity["engine_token"]), int(parity["golden_token"])
    return (f"the engine's greedy continuation of the golden prompt leaves the model's at token "
            f"{int(parity['diverged_at']) + 1} of {GOLDEN_STEPS}: it picks {mine} ({tok.decode([mine])!r}), the model "
            f"{theirs} ({tok.decode([theirs])!r})")


def _build_into(work: Path, export_dir: Path, export: ExportManifest, cfg: BuildConfig,
                progress: Progress) -> EngineManifest:
    import onnxruntime as ort

    threads = cfg.threads or default_threads()
    scratch = work / "scratch"
    scratch.mkdir()
    src_dir, kv, graphs = export_dir, export.kv, (export.prefill, export.decode)
    library = library_path() if cfg.uses_llmc_ops() else None
    if cfg.kv_layout is KVLayout.inplace:
        experts = (f", the experts at {cfg.quant.value} on ONNX Runtime's QMoE (--moe ort: one precision for every "
                   "expert of a layer, outside the quality search; --moe standard makes each a layer of its own)"
                   if cfg.quant is not Quant.none and cfg.moe is MoELowering.ort and export.model.num_experts else "")
        progress.step(f"lowering attention to {cfg.attention.value} with an in-place {cfg.kv_dtype.value} KV cache "
                      f"(weights: {cfg.quant.value}{', llmc operators' if cfg.matmul is MatMul.llmc else ''}{experts})")
        ckpt = with_moe_weights(load_checkpoint(export_dir, export), cfg.moe.value)  # before quantizing: experts too
        quant = cfg.quant_spec()
        if quant is not None:
            ckpt = quantized(ckpt, quant)
        if cfg.bf16():
            ckpt = bf16_weights(ckpt)
        ckpt = with_head_parts(with_compact_embedding(ckpt))
        src_dir = scratch / "lowered"
        src_dir.mkdir()
        kv, *lowered = write_inplace_graphs(ckpt, src_dir, export.dtype, export.opset, quant, cfg.attention.value,
                                            fuse_norms=True, one_graph=True, kv_dtype=cfg.kv_dtype.value,
                                            moe=cfg.moe.value, paged=cfg.kv_paged and cfg.attention.value == "llmc")
        graphs = (lowered[0], lowered[1])
    progress.step("optimizing graphs with ONNX Runtime (offline, saved)")
    graph_files = list(dict.fromkeys(g.file for g in graphs))  # in-place engines: one graph for both
    for file in graph_files:
        _optimize(src_dir / file, scratch / file, threads, library)
    progress.step("storing the optimized weights once")
    _share_weights(scratch, work, graph_files)
    shutil.rmtree(scratch)
    for name in RUNTIME_FILES:
        if (export_dir / name).is_file():
            shutil.copy2(export_dir / name, work / name)
    files = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file()}
    settings = EngineSettings(
        threads=threads, optimization="extended", **cfg.choices(),  # type: ignore[arg-type]
        attention=cfg.attention.value if kv.layout == "inplace" else "decomposed", block_size=cfg.block_size,
        accuracy_level=cfg.accuracy_level, onnxruntime=ort.__version__,
        llmc_ops=ops_version() if library is not None else "")  # the contract the graphs were built for
    precision = "bfloat16" if cfg.bf16() else export.dtype if cfg.quant is Quant.none else \
        f"{cfg.quant.value}-{export.dtype}"
    manifest = engine_manifest(export, export_dir, "ort", precision, settings, files, graphs, kv)
    progress.step("checking the engine against the golden outputs")
    from llmc.engines.registry import load_engine_dir
    from llmc.runtime.verify import check_golden

    save(manifest, work)
    parity = check_golden(load_engine_dir(work, EngineOptions(threads=threads)), Golden.load(work / "golden.npz"))
    manifest = replace(manifest, settings=replace(settings, parity=parity))
    save(manifest, work)
    return manifest


def _optimize(src: Path, dst: Path, threads: int, library: Path | None) -> None:
    import onnxruntime as ort

    so = ort.SessionOptions()
    if library is not None:
        register(so, library)
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
