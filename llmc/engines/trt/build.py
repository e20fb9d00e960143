"""`llmc build --backend trt`: FP16 TensorRT engines (prefill.plan, decode.plan) from an export.

Steps: rebuild the in-place graphs in fp16 from the export's weights, the KV buffers' sequence axis written as the
static --max-seq-len; lower attention to the `llmc::attention` plugin (its K/V outputs aliased to the cache inputs:
the ALIASED_PLUGIN_IO_10_03 preview feature), or, with attention "native", keep standard Attention + TensorScatter
ops (TensorRT >= 10.15) over the whole fixed-size buffer under a [B, 1, S, max_seq] mask (the "onnx-static"
lowering: no data-dependent key length); parse into a strongly typed network (the graph's own fp16 / fp32 types);
one optimization profile per engine, planned from TrtLimits; a timing cache kept in the engine folder (and reused by
a rebuild into it); versions, GPU, profiles and checksums in the manifest; the golden check.
The TensorRT calls sit in `_TrtBuilder`; everything else is plain Python, tested on the CPU.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from llmc.engines.ort.build import RUNTIME_FILES, BuildConfig, engine_manifest
from llmc.engines.trt.profiles import GRAPHS, Profile, TrtLimits, plan_profiles
from llmc.errors import BackendUnavailableError, InputError, LlmcError
from llmc.graph.checkpoint import ROPE_TABLES, Checkpoint
from llmc.graph.moe import float32_weights
from llmc.manifest import (
    EngineManifest,
    EngineSettings,
    ExportManifest,
    KVSpec,
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
TRITON_PIN = (3, 9)  # the Triton release the plugin kernel is compiled and tested with (pyproject extras)
ALIASED_PLUGIN_IO = "ALIASED_PLUGIN_IO_10_03"  # PreviewFeature that makes TensorRT honour the plugin's aliases
NATIVE_LOWERING = "onnx-static"  # the graph lowering --attention native builds from
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
    if model.attn_sinks:
        raise InputError("the model's attention sinks (GPT-OSS) are in neither TensorRT attention (plugin, native) "
                         "here: build it with --backend ort")
    if model.attention_chunk and cfg.attention == "plugin":
        raise InputError(f"the model's chunked attention (blocks of {model.attention_chunk} positions: Llama 4) is not "
                         "in llmc's attention plugin: build with --attention native (its mask holds the chunks)")
    if model.has_states:
        raise InputError("the model's convolution, linear-attention or Mamba-2 layers (LFM2, Qwen3.5, Granite 4.0-H, "
                         "Nemotron-H) keep a state per sequence, which the TensorRT engines do not hold: build it with "
                         "--backend ort")
    if model.per_layer_attention:
        raise InputError("the model's layers of different head sizes, or reading each other's KV caches (Gemma 4), "
                         "have not run in a TensorRT engine here: build it with --backend ort")
    if any(model.index_layers):
        raise InputError(f"the model's indexed attention (Kolibri 1.1: each query's keys chosen by routing scores past "
                         f"{model.index_budget} of them) has no TensorRT plugin here: build it with --backend ort")
    if model.mla_kv_rank:
        raise InputError(f"the model's latent attention ({model.num_heads} query heads on one KV head of "
                         f"{model.head_dim} dims) has not run in a TensorRT engine here: build it with --backend ort")
    limits = cfg.limits_for(model)
    limits.check_model(model.max_positions)
    check_alignment(model, limits.max_seq_len)


def fp16_checkpoint(ckpt: Checkpoint) -> Checkpoint:
    """Weights in fp16; the rotary frequencies stay fp32 (positions x frequencies needs the precision), and the
    routers transformers keeps in fp32."""
    keep = float32_weights(ckpt.spec)  # (GLM-4.5's routers: transformers keeps them in fp32)
    weights = {k: v if k in ROPE_TABLES or k in keep or v.dtype.kind != "f" else v.astype(np.float16)
               for k, v in ckpt.weights.items()}
    return Checkpoint(ckpt.spec, weights)


def check_triton(version: str) -> None:
    """The plugin's kernel is compiled ahead of time with the Triton release it is tested with (TRITON_PIN): older ones
    lack `ASTSource(constexprs=...)` with constexpr signature entries, newer ones may change the hidden kernel
    parameters (`plugin.trim_parameters` leaves 3.9's two scratch pointers out of what TensorRT launches)."""
    if version_tuple(version)[:2] != TRITON_PIN:
        pin = ".".join(map(str, TRITON_PIN))
        raise BackendUnavailableError(f"--attention plugin compiles its kernel with Triton {pin}.x, this machine has "
                                      f"Triton {version}: pip install 'triton=={pin}.*'")


def require_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        pin = ".".join(map(str, TRITON_PIN))
        raise BackendUnavailableError(f"Triton is not installed: --attention plugin needs pip install "
                                      f"'triton=={pin}.*' (or use --attention native)")
    import triton

    check_triton(triton.__version__)


def static_kv_axis(path: Path, kv: KVSpec, max_seq_len: int) -> int:
    """Write --max-seq-len on axis 2 (max_sequence) of every past and present tensor of one graph file (TensorRT's
    KV-cache update wants a cache input with a static sequence length); returns how many tensors were fixed."""
    from llmc.onnx_store import load_graph

    proto = load_graph(path)
    names = {*kv.names("past"), *kv.names("present")}
    fixed = 0
    for value in (*proto.graph.input, *proto.graph.output):
        if value.name in names:
            dim = value.type.tensor_type.shape.dim[2]
            dim.Clear()
            dim.dim_value = max_seq_len
            fixed += 1
    onnx.save(proto, str(path))
    return fixed


def trt_settings(cfg: TrtBuildConfig, limits: TrtLimits, profiles: dict[str, Profile],
                 env: dict[str, str]) -> EngineSettings:
    """What the runtime needs (limits, profiles, versions) and what a reader wants to know about the build."""
    return EngineSettings(kv_layout="inplace", attention=cfg.attention, precision=cfg.precision,
                          limits=asdict(limits), profiles={g: profiles[g].to_json() for g in GRAPHS},
                          tensorrt=env["tensorrt"], gpu=env["gpu"], compute_capability=env["compute_capability"],
                          timing_cache=TIMING_CACHE)


class _TrtBuilder:
    """The TensorRT calls of one build: one builder and one timing cache shared by both engines.

    Networks are strongly typed on every release (TensorRT >= 10): the graph's own types decide each layer's
    precision (fp16 compute, the fp32 norm statistics, rotary tables and logits cast), with no FP16 flag, per-layer
    precision or pinning. With the plugin, its K/V outputs alias the cache inputs (written in place), which TensorRT
    honours only under the ALIASED_PLUGIN_IO_10_03 preview feature.
    """

    def __init__(self, trt: Any, cache: bytes, attention: str) -> None:
        self.trt = trt
        self.aliased_plugin_io = attention == "plugin"  # the plugin's K/V outputs alias its cache inputs
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.builder = trt.Builder(self.logger)
        config = self.builder.create_builder_config()
        self.cache = config.create_timing_cache(cache)
        if cache and not config.set_timing_cache(self.cache, False):  # another GPU or TensorRT: start afresh
            self.cache = config.create_timing_cache(b"")

    def parse(self, path: Path) -> tuple[Any, Any]:
        """The network and its parser (which owns the weights: keep it alive until the build is done)."""
        trt = self.trt
        flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # 11.x: accepted, always on
        network = self.builder.create_network(0 if flag is None else 1 << int(flag))
        parser = self.trt.OnnxParser(network, self.logger)
        if not parser.parse_from_file(str(path)):
            errors = "\n".join(f"  {parser.get_error(i)}" for i in range(parser.num_errors))
            raise LlmcError(f"TensorRT could not parse {path.name} ({parser.num_errors} errors):\n{errors}")
        return network, parser

    def config(self, profile: Profile) -> Any:
        trt = self.trt
        config = self.builder.create_builder_config()
        if self.aliased_plugin_io:
            feature = getattr(trt.PreviewFeature, ALIASED_PLUGIN_IO, None)
            if feature is None:
                raise BackendUnavailableError(f"TensorRT {trt.__version__} has no PreviewFeature.{ALIASED_PLUGIN_IO}: "
                                              "the plugin's in-place KV write needs TensorRT >= 10.3")
            config.set_preview_feature(feature, True)
        config.set_timing_cache(self.cache, False)
        shapes = self.builder.create_optimization_profile()
        for name, r in profile.inputs.items():
            shapes.set_shape(name, r.min, r.opt, r.max)
        config.add_optimization_profile(shapes)
        return config

    def build(self, path: Path, profile: Profile) -> bytes:
        """The serialized engine."""
        network, _parser = self.parse(path)
        plan = self.builder.build_serialized_network(network, self.config(profile))
        if plan is None:
            raise LlmcError(f"TensorRT failed to build the {profile.graph} engine from {path.name} (see its log)")
        return bytes(plan)

    def serialized_cache(self) -> bytes:
        return bytes(self.cache.serialize())


def build_trt(cfg: BuildConfig | TrtBuildConfig, progress: Progress | None = None) -> EngineManifest:
    tcfg = cfg if isinstance(cfg, TrtBuildConfig) else trt_config_from(cfg)
    progress = progress or Quiet()
    require_tensorrt()
    import tensorrt as trt

    from llmc.engines.trt.run import gpu_info

    check_tensorrt(trt.__version__, tcfg.attention)
    if tcfg.attention == "plugin":
        require_triton()
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
        builder = _TrtBuilder(trt, cache, tcfg.attention)
        return _build_into(work, export, tcfg, builder, env, progress)


def _write_graphs(scratch: Path, export: ExportManifest, cfg: TrtBuildConfig) -> tuple[Any, ...]:
    """fp16 in-place graphs, their KV buffers' sequence axis the static --max-seq-len: Attention + TensorScatter
    lowered to the plugin, or (native) the whole-buffer "onnx-static" lowering kept as standard ops."""
    from llmc.engines.ort.graphs import load_checkpoint, write_inplace_graphs
    from llmc.engines.trt.lower import lower_file

    ckpt = fp16_checkpoint(load_checkpoint(cfg.export_dir, export))
    lowering = "onnx" if cfg.attention == "plugin" else NATIVE_LOWERING
    kv, prefill, decode = write_inplace_graphs(ckpt, scratch, "float16", export.opset, None, lowering, moe="dense")
    if cfg.attention == "plugin":
        from llmc.engines.trt.plugin import register_trt_plugin

        register_trt_plugin()
        for name, spec in (("prefill", prefill), ("decode", decode)):
            lower_file(scratch / spec.file, export.model, name)
    max_seq_len = cfg.limits_for(export.model).max_seq_len
    for spec in (prefill, decode):
        static_kv_axis(scratch / spec.file, kv, max_seq_len)
    return kv, prefill, decode


def build_plans(work: Path, export: ExportManifest, cfg: TrtBuildConfig, builder: _TrtBuilder,
                progress: Progress) -> tuple[Any, Any, Any, dict[str, Profile]]:
    """prefill.plan, decode.plan and the timing cache into `work`; (kv, prefill, decode, profiles)."""
    scratch = work / "scratch"
    scratch.mkdir()
    progress.step(f"writing fp16 in-place graphs (attention: {cfg.attention})")
    kv, prefill, decode = _write_graphs(scratch, export, cfg)
    limits = cfg.limits_for(export.model)
    profiles = plan_profiles(limits, prefill, decode)
    for name, spec in (("prefill", prefill), ("decode", decode)):
        progress.step(f"building {name}.plan with TensorRT (fp16, profile {profiles[name].to_json()['input_ids']})")
        (work / f"{name}.plan").write_bytes(builder.build(scratch / spec.file, profiles[name]))
    (work / TIMING_CACHE).write_bytes(builder.serialized_cache())
    shutil.rmtree(scratch)
    return kv, prefill, decode, profiles


def _build_into(work: Path, export: ExportManifest, cfg: TrtBuildConfig, builder: _TrtBuilder,
                env: dict[str, str], progress: Progress) -> EngineManifest:
    kv, prefill, decode, profiles = build_plans(work, export, cfg, builder, progress)
    limits = cfg.limits_for(export.model)
    for file in RUNTIME_FILES:
        if (cfg.export_dir / file).is_file():
            shutil.copy2(cfg.export_dir / file, work / file)
    files = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file() and p.name != TIMING_CACHE}
    graphs = (replace(prefill, file="prefill.plan"), replace(decode, file="decode.plan"))
    settings = trt_settings(cfg, limits, profiles, env)
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
