"""`llmc build --backend trt`: FP16 TensorRT engines (prefill.plan, decode.plan) from an export.

Steps: rebuild the in-place "onnx"-attention graphs in fp16 from the export's weights; lower attention to the
`llmc::attention` plugin (or, with attention "native", keep the standard Attention + TensorScatter ops that
TensorRT >= 10.15 parses); parse; keep every fp32-typed layer (norms, rotary tables, the logits cast) in fp32 under
the FP16 flag; one optimization profile per engine, planned from TrtLimits; a timing cache kept in the engine folder
(and reused by a rebuild into it); versions, GPU, profiles and checksums in the manifest; the golden check.
The TensorRT calls sit in `_TrtBuilder`; everything else is plain Python, tested on the CPU.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from llmc.engines.ort_build import RUNTIME_FILES, BuildConfig, engine_manifest
from llmc.engines.trt_profiles import GRAPHS, Profile, TrtLimits, plan_profiles
from llmc.errors import BackendUnavailableError, InputError, LlmcError
from llmc.graph.checkpoint import ROPE_TABLES, Checkpoint
from llmc.manifest import (
    EngineManifest,
    EngineSettings,
    ExportManifest,
    ModelSpec,
    load_export,
    save,
    sha256_file,
    verify_files,
)
from llmc.outdir import atomic_dir, check_out_dir
from llmc.progress import Progress, Quiet

TIMING_CACHE = "timing.cache"
PLUGIN_MIN_TRT = (10, 9)  # ahead-of-time Python plugins (tensorrt.plugin.aot_impl)
NATIVE_MIN_TRT = (10, 15)  # ONNX Attention + TensorScatter parsed into TensorRT's own layers
BINDING_ALIGN = 256  # bytes: TensorRT's alignment for tensor addresses (each KV slot row is bound on its own)


@dataclass(frozen=True)
class TrtBuildConfig:
    """`llmc build --backend trt`: the common build settings plus what only TensorRT needs."""

    base: BuildConfig
    limits: TrtLimits | None = None  # None: default_limits(model)
    precision: str = "fp16"
    attention: str = "plugin"  # plugin (llmc::attention, Triton AOT kernel) | native (TensorRT >= 10.15 layers)

    @property
    def backend(self) -> str:
        return "trt"

    def limits_for(self, model: ModelSpec) -> TrtLimits:
        return self.limits or default_limits(model)

    @property
    def export_dir(self) -> Path:
        return Path(self.base.export_dir)

    @property
    def out_dir(self) -> Path:
        return Path(self.base.out_dir)


def trt_config_from(cfg: BuildConfig, limits: TrtLimits | None = None, precision: str = "fp16",
                    attention: str = "plugin") -> TrtBuildConfig:
    return TrtBuildConfig(cfg, limits, precision, attention)


def default_limits(model: ModelSpec) -> TrtLimits:
    """8 rows, 512-token prompts, 2048 positions, each capped by the model (positions in multiples of 128)."""
    seq = min(2048, model.max_positions)
    seq = seq - seq % 128 if seq >= 128 else seq
    return TrtLimits(max_batch_size=8, max_input_len=min(512, seq), max_seq_len=seq)


def require_tensorrt() -> None:
    if importlib.util.find_spec("tensorrt") is None:
        raise BackendUnavailableError(
            "TensorRT is not installed: --backend trt needs an NVIDIA GPU and pip install 'llmc[trt]'; "
            "use --backend ort on this machine"
        )


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def check_tensorrt(version: str, attention: str) -> None:
    need = PLUGIN_MIN_TRT if attention == "plugin" else NATIVE_MIN_TRT
    if version_tuple(version) < need:
        what = "ahead-of-time plugins" if attention == "plugin" else "native Attention + TensorScatter"
        raise BackendUnavailableError(f"--attention {attention} needs TensorRT >= {'.'.join(map(str, need))} "
                                      f"({what}), this machine has {version}")


def check_alignment(model: ModelSpec, max_seq_len: int) -> None:
    row = model.num_kv_heads * max_seq_len * model.head_dim * 2
    if row % BINDING_ALIGN:
        raise InputError(f"--max-seq-len {max_seq_len} makes each KV slot {row} bytes; TensorRT binds slots at "
                         f"{BINDING_ALIGN}-byte aligned addresses: use a multiple of 128")


def check_trt_config(cfg: TrtBuildConfig, model: ModelSpec) -> None:
    if cfg.precision != "fp16":
        raise InputError(f"--precision must be fp16 for --backend trt, got {cfg.precision!r}")
    if cfg.attention not in ("plugin", "native"):
        raise InputError(f"--attention must be plugin or native for --backend trt, got {cfg.attention!r}")
    if cfg.base.quant != "none":
        raise InputError(f"--quant {cfg.base.quant.value} is for --backend ort; TensorRT engines are fp16")
    limits = cfg.limits_for(model)
    limits.check_model(model.max_positions)
    check_alignment(model, limits.max_seq_len)


def fp16_checkpoint(ckpt: Checkpoint) -> Checkpoint:
    """Weights in fp16; the rotary frequencies stay fp32 (positions x frequencies needs the precision)."""
    weights = {k: v if k in ROPE_TABLES or v.dtype.kind != "f" else v.astype(np.float16) for k, v in ckpt.weights.items()}
    return Checkpoint(ckpt.spec, weights)


def fp32_layers(layers: Iterable[Any], float32: Any, skip: Iterable[Any] = ()) -> list[Any]:
    """Layers whose outputs are all fp32 in the parsed network: the graph's explicit fp32 regions (norm statistics,
    rotary tables, the logits cast). Under the FP16 flag TensorRT may otherwise run them in fp16."""
    skip = set(skip)
    return [layer for layer in layers if layer.type not in skip and layer.num_outputs > 0
            and all(layer.get_output(j).dtype == float32 for j in range(layer.num_outputs))]


def trt_settings(cfg: TrtBuildConfig, limits: TrtLimits, profiles: dict[str, Profile], env: dict[str, str],
                 fp32: dict[str, int]) -> EngineSettings:
    """What the runtime needs (limits, profiles, versions) and what a reader wants to know about the build."""
    return EngineSettings(kv_layout="inplace", attention=cfg.attention, precision=cfg.precision,
                          limits=asdict(limits), profiles={g: profiles[g].to_json() for g in GRAPHS},
                          tensorrt=env["tensorrt"], gpu=env["gpu"], compute_capability=env["compute_capability"],
                          fp32_layers=fp32, timing_cache=TIMING_CACHE)


class _TrtBuilder:
    """The TensorRT calls of one build: one builder and one timing cache shared by both engines."""

    def __init__(self, trt: Any, cache: bytes) -> None:
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.builder = trt.Builder(self.logger)
        config = self.builder.create_builder_config()
        self.cache = config.create_timing_cache(cache)
        if cache and not config.set_timing_cache(self.cache, False):  # another GPU or TensorRT: start afresh
            self.cache = config.create_timing_cache(b"")

    @property
    def weakly_typed(self) -> bool:
        """FP16 flag + per-layer precision; TensorRT releases without the flag get a strongly typed network, which
        keeps the graph's own types (fp16 compute, fp32 norms) exactly."""
        return hasattr(self.trt.BuilderFlag, "FP16")

    def parse(self, path: Path) -> tuple[Any, Any]:
        """The network and its parser (which owns the weights: keep it alive until the build is done)."""
        trt = self.trt
        flags = 0 if self.weakly_typed else 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = self.builder.create_network(flags)
        parser = self.trt.OnnxParser(network, self.logger)
        if not parser.parse_from_file(str(path)):
            errors = "\n".join(f"  {parser.get_error(i)}" for i in range(parser.num_errors))
            raise LlmcError(f"TensorRT could not parse {path.name} ({parser.num_errors} errors):\n{errors}")
        return network, parser

    def pin_fp32(self, network: Any) -> int:
        trt = self.trt
        layers = fp32_layers((network.get_layer(i) for i in range(network.num_layers)), trt.float32,
                             skip=(trt.LayerType.CONSTANT, trt.LayerType.SHAPE))
        for layer in layers:
            layer.precision = trt.float32
            for j in range(layer.num_outputs):
                layer.set_output_type(j, trt.float32)
        return len(layers)

    def config(self, profile: Profile) -> Any:
        trt = self.trt
        config = self.builder.create_builder_config()
        if self.weakly_typed:
            config.set_flag(trt.BuilderFlag.FP16)
            config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        config.set_timing_cache(self.cache, False)
        shapes = self.builder.create_optimization_profile()
        for name, r in profile.inputs.items():
            shapes.set_shape(name, r.min, r.opt, r.max)
        config.add_optimization_profile(shapes)
        return config

    def build(self, path: Path, profile: Profile) -> tuple[bytes, int]:
        """Serialized engine and the number of layers kept in fp32."""
        network, _parser = self.parse(path)
        pinned = self.pin_fp32(network) if self.weakly_typed else 0
        plan = self.builder.build_serialized_network(network, self.config(profile))
        if plan is None:
            raise LlmcError(f"TensorRT failed to build the {profile.graph} engine from {path.name} (see its log)")
        return bytes(plan), pinned

    def serialized_cache(self) -> bytes:
        return bytes(self.cache.serialize())


def build_trt(cfg: BuildConfig | TrtBuildConfig, progress: Progress | None = None) -> EngineManifest:
    tcfg = cfg if isinstance(cfg, TrtBuildConfig) else trt_config_from(cfg)
    progress = progress or Quiet()
    require_tensorrt()
    import tensorrt as trt

    from llmc.engines.trt import gpu_info

    check_tensorrt(trt.__version__, tcfg.attention)
    gpu, capability = gpu_info()
    env = {"tensorrt": trt.__version__, "gpu": gpu, "compute_capability": capability}
    export = load_export(tcfg.export_dir)
    check_trt_config(tcfg, export.model)
    check_out_dir(tcfg.out_dir, tcfg.base.force)
    progress.step(f"checking export {tcfg.export_dir} ({export.model_name}) for TensorRT {env['tensorrt']} on {gpu}")
    verify_files(tcfg.export_dir, export.files)
    old_cache = tcfg.out_dir / TIMING_CACHE
    cache = old_cache.read_bytes() if old_cache.is_file() else b""
    with atomic_dir(tcfg.out_dir, tcfg.export_dir, "export") as work:
        return _build_into(work, export, tcfg, _TrtBuilder(trt, cache), env, progress)


def _write_graphs(scratch: Path, export: ExportManifest, cfg: TrtBuildConfig) -> tuple[Any, ...]:
    """fp16 in-place graphs with Attention + TensorScatter, lowered to the plugin unless attention is native."""
    from llmc.engines.ort_graphs import load_checkpoint, write_inplace_graphs
    from llmc.engines.trt_lower import lower_file

    ckpt = fp16_checkpoint(load_checkpoint(cfg.export_dir, export))
    kv, prefill, decode = write_inplace_graphs(ckpt, scratch, "float16", export.opset, None, "onnx", moe="dense")
    if cfg.attention == "plugin":
        from llmc.engines.trt_plugin import register_trt_plugin

        register_trt_plugin()
        for name, spec in (("prefill", prefill), ("decode", decode)):
            lower_file(scratch / spec.file, export.model, name)
    return kv, prefill, decode


def _build_into(work: Path, export: ExportManifest, cfg: TrtBuildConfig, builder: _TrtBuilder,
                env: dict[str, str], progress: Progress) -> EngineManifest:
    scratch = work / "scratch"
    scratch.mkdir()
    progress.step(f"writing fp16 in-place graphs (attention: {cfg.attention})")
    kv, prefill, decode = _write_graphs(scratch, export, cfg)
    limits = cfg.limits_for(export.model)
    profiles = plan_profiles(limits, prefill, decode)
    fp32 = {}
    for name, spec in (("prefill", prefill), ("decode", decode)):
        progress.step(f"building {name}.plan with TensorRT (fp16, profile {profiles[name].to_json()['input_ids']})")
        plan, fp32[name] = builder.build(scratch / spec.file, profiles[name])
        (work / f"{name}.plan").write_bytes(plan)
    (work / TIMING_CACHE).write_bytes(builder.serialized_cache())
    shutil.rmtree(scratch)
    for file in RUNTIME_FILES:
        if (cfg.export_dir / file).is_file():
            shutil.copy2(cfg.export_dir / file, work / file)
    files = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file() and p.name != TIMING_CACHE}
    graphs = (replace(prefill, file="prefill.plan"), replace(decode, file="decode.plan"))
    settings = trt_settings(cfg, limits, profiles, env, fp32)
    manifest = engine_manifest(export, cfg.export_dir, "trt", cfg.precision, settings, files, graphs, kv)
    save(manifest, work)
    progress.step("checking the engine against the golden outputs")
    from llmc.engines.registry import load_engine_dir
    from llmc.golden import Golden
    from llmc.runtime.verify import check_golden

    parity = check_golden(load_engine_dir(work), Golden.load(work / "golden.npz"))
    manifest = replace(manifest, settings=replace(settings, parity=parity))
    save(manifest, work)
    return manifest
