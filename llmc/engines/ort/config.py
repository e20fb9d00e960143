"""What `llmc build --backend ort` is asked to build: one frozen config, its choices validated once, and the `auto`
choices resolved against the export and this CPU into the fastest engine llmc knows to build here."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path

from llmc.engines.choices import (
    Attention,
    KVDtype,
    KVLayout,
    MatMul,
    MoELowering,
    Quant,
    WeightsDtype,
    choice,
)
from llmc.errors import BackendUnavailableError, InputError
from llmc.graph.quant import SCHEMES, TILE_BLOCK, QuantSpec
from llmc.manifest import ExportManifest
from llmc.outdir import check_out_dir

MOE_UNROLL_MAX = 32  # experts per layer up to which the "standard" (unrolled) mixture lowering is the default
_FLAGS: dict[str, tuple[str, type[Enum]]] = {
    "quant": ("--quant", Quant), "dtype": ("--dtype", WeightsDtype), "kv_layout": ("--kv-layout", KVLayout),
    "attention": ("--attention", Attention),
    "kv_dtype": ("--kv-dtype", KVDtype), "matmul": ("--matmul", MatMul), "moe": ("--moe", MoELowering)}


@dataclass(frozen=True)
class BuildConfig:
    export_dir: Path
    out_dir: Path
    backend: str = "ort"
    # the choices: Enum members (callers may pass their string values: converted, or refused naming the flag)
    quant: Quant = Quant.none
    threads: int = 0
    force: bool = False
    kv_layout: KVLayout = KVLayout.inplace
    attention: Attention = Attention.auto  # the in-place lowering
    kv_dtype: KVDtype = KVDtype.auto  # the KV cache's dtype (float16 / int8: llmc attention on fp32 exports)
    kv_paged: bool = True  # llmc attention: paged KV memory (block pools, block tables); False: a slot per sequence
    block_size: int = 32
    accuracy_level: int = 4
    quant_scheme: str = "auto"
    matmul: MatMul = MatMul.auto  # --quant: ort (MatMulNBits) | llmc (llmc's MatMulQ4 / MatMulQ8)
    moe: MoELowering = MoELowering.auto  # mixture-of-experts lowering
    allow_divergence: bool = False  # keep an engine whose greedy golden continuation leaves the model's
    quality_target: float = 0.99  # --quant: top-1 agreement with the model the layer precisions are chosen for
    quality_bytes: float = 1.15  # --quant: most weight bytes per step the raised layers may take, x all at --quant
    layout: tuple[tuple[str, str], ...] = ()  # --quant: per-layer precisions (chosen by measurement, quality.py)
    dtype: WeightsDtype = WeightsDtype.auto  # the linear layers' weights: the export's, or bfloat16

    def __post_init__(self) -> None:
        for name, (flag, kind) in _FLAGS.items():  # strings from callers become the Enums, or a one-line error
            object.__setattr__(self, name, choice(kind, getattr(self, name), flag))
        object.__setattr__(self, "export_dir", Path(self.export_dir))
        object.__setattr__(self, "out_dir", Path(self.out_dir))

    def quant_spec(self) -> QuantSpec | None:
        if self.quant is Quant.none:
            return None
        return QuantSpec(bits=int(self.quant.value.removeprefix("int")), block_size=self.block_size,
                         accuracy_level=self.accuracy_level, scheme=self.quant_scheme, kernel=self.matmul.value,
                         layout=self.layout)

    def uses_llmc_ops(self) -> bool:
        """Whether the engine's graphs hold llmc's own operators (a resolved config)."""
        return self.kv_layout is KVLayout.inplace and (self.attention is Attention.llmc or
                                                        self.matmul is MatMul.llmc or self.bf16())

    def bf16(self) -> bool:
        """bf16 weights (llmc's MatMulBF16)."""
        return self.dtype is WeightsDtype.bfloat16

    def choices(self) -> dict[str, str]:
        """The resolved choices as engine.json records them (EngineSettings fields)."""
        return {f.name: getattr(self, f.name).value for f in fields(self)
                if isinstance(getattr(self, f.name), Enum) and f.name != "attention"}


def check_build_config(cfg: BuildConfig) -> None:
    """Rules between the choices (each alone was checked when the config was made)."""
    explicit_kv = cfg.kv_dtype not in (KVDtype.auto, KVDtype.float32)
    if explicit_kv and cfg.attention not in (Attention.llmc, Attention.auto):
        raise InputError(f"--kv-dtype {cfg.kv_dtype.value} needs --attention llmc (got --attention "
                         f"{cfg.attention.value})")
    if cfg.bf16() and (cfg.quant is not Quant.none or cfg.kv_layout is KVLayout.concat):
        raise InputError("--dtype bfloat16 is the weights' precision: it takes neither --quant nor --kv-layout concat")
    if cfg.quant is not Quant.none and cfg.kv_layout is KVLayout.concat:
        raise InputError("--quant needs --kv-layout inplace (the concat layout runs the export's graphs as they are)")
    if cfg.block_size not in (16, 32, 64, 128, 256):
        raise InputError(f"--block-size must be one of 16, 32, 64, 128, 256, got {cfg.block_size}")
    if cfg.quant_scheme not in SCHEMES:
        raise InputError(f"--quant-scheme must be one of {', '.join(SCHEMES)}, got {cfg.quant_scheme!r}")
    if cfg.matmul is MatMul.llmc and cfg.quant is Quant.none:
        raise InputError("--matmul llmc is the quantized layers' kernel: it needs --quant int4 or int8 (got --quant "
                         "none)")
    if cfg.matmul is MatMul.llmc and cfg.block_size != TILE_BLOCK:
        raise InputError(f"--matmul llmc works in blocks of {TILE_BLOCK}, got --block-size {cfg.block_size}")
    if not 0.0 <= cfg.quality_target <= 1.0:
        raise InputError(f"--quality-target must be in [0, 1] (0: no search), got {cfg.quality_target}")
    if not 1.0 <= cfg.quality_bytes <= 16.0:
        raise InputError(f"--quality-bytes must be in [1, 16] (times the weight bytes with every layer at --quant), "
                         f"got {cfg.quality_bytes}")
    if cfg.accuracy_level not in (0, 1, 2, 3, 4):
        raise InputError(f"--accuracy-level must be in [0, 4], got {cfg.accuracy_level}")
    if cfg.threads < 0:
        raise InputError(f"--threads must be >= 0 (0 = physical cores), got {cfg.threads}")
    check_out_dir(cfg.out_dir, cfg.force)


def resolve(cfg: BuildConfig, export: ExportManifest) -> BuildConfig:
    """Every `auto` choice made for this export and CPU: llmc's attention (fp16 cache) where its AVX-512 path runs
    and the export is fp32, llmc's 4-/8-bit operators for --quant where their VNNI or AVX2 path runs (both measured
    faster than ONNX Runtime's own operators here: docs/benchmarks.md), the mixture lowering by expert count."""
    paths = _cpu_paths()
    fp32 = export.dtype == "float32"
    inplace = cfg.kv_layout is KVLayout.inplace
    attention = cfg.attention
    chunked = export.model.attention_chunk > 0  # (Llama 4: GroupQueryAttention has no chunked attention)
    if attention is Attention.auto:
        attention = (Attention.llmc if inplace and fp32 and paths.get("attention") == "avx512"
                     else Attention.onnx if chunked else Attention.gqa)
    if attention is Attention.gqa and chunked:
        raise InputError(f"--attention gqa: GroupQueryAttention has no chunked attention (this model's layers see "
                         f"blocks of {export.model.attention_chunk} positions); use --attention llmc or onnx")
    kv_dtype = cfg.kv_dtype
    if kv_dtype is KVDtype.auto:  # (Kolibri 1.1's indexed layers round their keys and values to NVFP4, a grid the
        # fp16 rounding of the layers before them moves values across: the tiny model's greedy answer leaves the
        # fp32 reference's there, top-1 89 %; its own NVFP4 caches are exact in either; BitNet's int8 activations
        # (act_quant) the same way: the tiny ternary model's top-1 97.3 % against 100 %, greedy match 23.2 / 32)
        grid = any(export.model.index_layers) or bool(export.model.act_quant)
        fp16 = attention is Attention.llmc and inplace and not grid
        kv_dtype = KVDtype.float16 if fp16 else KVDtype(export.dtype)
    matmul = cfg.matmul
    if matmul is MatMul.auto:
        fast = paths.get("matmul_q4") in ("avx512-vnni+amx-bf16", "avx512-vnni", "avx2")
        use = cfg.quant is not Quant.none and cfg.block_size == TILE_BLOCK and fp32 and inplace and fast
        matmul = MatMul.llmc if use else MatMul.ort
    moe = cfg.moe
    scaled = export.model.moe_scale_inputs  # (Llama 4: com.microsoft.MoE cannot run experts on scaled inputs)
    ungated = export.model.moe_activation == "relu2"  # (Nemotron-H's: com.microsoft.MoE has no squared ReLU)
    geglu = export.model.moe_activation == "gelu_tanh"  # (Gemma 4's: nor GeGLU experts)
    if moe is MoELowering.auto:
        moe = (MoELowering.standard if export.model.num_experts <= MOE_UNROLL_MAX or scaled or ungated or geglu
               else MoELowering.ort)
    if moe is MoELowering.ort and geglu:
        raise InputError("--moe ort: com.microsoft.MoE has no GeGLU experts (this model's: Gemma 4's); use --moe "
                         "standard or loop")
    if moe is MoELowering.ort and ungated:
        raise InputError("--moe ort: com.microsoft.MoE has no squared ReLU for this model's ungated experts; use --moe "
                         "standard")
    if moe is MoELowering.ort and scaled:
        raise InputError("--moe ort: com.microsoft.MoE weights the experts' outputs, and this model's experts run on "
                         "inputs scaled by their routing weights; use --moe standard")
    dtype = WeightsDtype(export.dtype) if cfg.dtype is WeightsDtype.auto and export.dtype in (
        "float32", "bfloat16") else cfg.dtype
    if dtype is WeightsDtype.bfloat16 and not fp32:
        raise InputError(f"--dtype bfloat16 builds from a float32 export, got a {export.dtype} one")
    resolved = replace(cfg, attention=attention, kv_dtype=kv_dtype, matmul=matmul, moe=moe, dtype=dtype)
    if resolved.kv_dtype.value != export.dtype and not (inplace and attention is Attention.llmc):
        raise InputError(f"--kv-dtype {kv_dtype.value} differs from the export's {export.dtype}: only "
                         "--attention llmc (in place) takes another cache dtype")
    if resolved.uses_llmc_ops() and not fp32:
        wanted_by = "--attention llmc" if attention is Attention.llmc else "--matmul llmc"
        raise InputError(f"{wanted_by} computes in float32 and the export is {export.dtype}; leave it out for this "
                         "export")
    return resolved


def conservative(cfg: BuildConfig) -> BuildConfig:
    """ONNX Runtime's own operators in place of llmc's `auto` picks (what a build falls back to when those fail
    their checks)."""
    return replace(cfg, attention=Attention.gqa if cfg.attention is Attention.auto else cfg.attention,
                   kv_dtype=KVDtype.auto if cfg.kv_dtype is KVDtype.auto else cfg.kv_dtype,
                   matmul=MatMul.ort if cfg.matmul is MatMul.auto else cfg.matmul)


def _cpu_paths() -> dict[str, str]:
    from llmc.engines.kernels import cpu_paths

    try:
        return cpu_paths()
    except BackendUnavailableError:  # not built: llmc's operators are not an option here
        return {}
