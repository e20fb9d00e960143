"""`llmc build EXPORT_DIR --backend ort -o ENGINE_DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from llmc.engines.choices import (
    Attention,
    Backend,
    KVDtype,
    KVLayout,
    MatMul,
    MoELowering,
    Quant,
    WeightsDtype,
    choice,
)


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("build")
    @wrap
    def build_command(
        export_dir: Annotated[Path, typer.Argument(help="A folder written by `llmc export`.")],
        out: Annotated[Path, typer.Option("-o", "--out", help="Engine folder.")],
        backend: Annotated[Backend, typer.Option(help="ort: ONNX Runtime CPU; trt: TensorRT (NVIDIA GPU); ort-cuda: "
                                                      "ONNX Runtime's CUDA provider (fp16, NVIDIA GPU, the gpu "
                                                      "extra).")] = Backend.ort,
        quant: Annotated[Quant, typer.Option(help="Weight-only quantization (ort).")] = Quant.none,
        threads: Annotated[int, typer.Option(help="Threads recorded for the engine (0 = physical cores).")] = 0,
        kv_layout: Annotated[KVLayout, typer.Option(help="inplace (one past/present buffer) or concat (export "
                                                         "graphs).")] = KVLayout.inplace,
        attention: Annotated[str | None, typer.Option(
            help="Attention lowering. ort: auto (default: llmc where its AVX-512 path runs and the export is fp32, "
                 "else gqa, or onnx for chunked attention), gqa (GroupQueryAttention), llmc (llmc's own operator: reads the cache once per KV head, "
                 "takes --kv-dtype float16|int8), onnx (Attention + TensorScatter) or onnx-static (the same over "
                 "the whole buffer, a fixed key length); ort-cuda: auto or gqa; trt: plugin (llmc::attention, "
                 "default) or native (TensorRT >= 10.15 layers, the onnx-static graph).")] = None,
        dtype: Annotated[WeightsDtype, typer.Option(
            help="ort: the linear layers' weights: auto (the export's) or bfloat16 (half the bytes of float32, "
                 "through llmc's bf16 operator: AMX-BF16 tiles for prompts and AVX-512 BF16 for decode where the "
                 "CPU has them, else the weights widened to float32 in registers; activations, norms and softmax "
                 "stay float32)")] = WeightsDtype.auto,
        kv_dtype: Annotated[KVDtype, typer.Option(help="ort: the KV cache's dtype: auto (float16 with llmc "
                                                      "attention, else the export's), float32, float16 (half the "
                                                      "bytes a step reads) or int8 (~0.27 of them).")]
        = KVDtype.auto,
        kv_paged: Annotated[bool, typer.Option(help="ort, llmc attention: paged KV memory (blocks shared by all "
                                                    "sequences, prefix caching); --no-kv-paged: one slot of the "
                                                    "longest context per sequence.")] = True,
        block_size: Annotated[int, typer.Option(help="--quant: weights per scale along the input axis.")] = 32,
        accuracy_level: Annotated[int, typer.Option(help="--quant: MatMulNBits compute (4 = int8 activations, "
                                                         "0 = fp32).")] = 4,
        quant_scheme: Annotated[str, typer.Option(
            help="--quant: auto (folded, or symmetric where exact), folded, minmax (exact fp32 offsets), "
                 "symmetric (no offsets).")] = "auto",
        matmul: Annotated[MatMul, typer.Option(
            help="--quant: the quantized layers' kernel. auto (default: llmc where its VNNI or AVX2 path runs), ort "
                 "(ONNX Runtime's MatMulNBits) or llmc (llmc's own operators: GGUF Q4_1's scale + min blocks and "
                 "Q8_0's blocks exactly, the SwiGLU gate in the same node, the 8-bit head too).")] = MatMul.auto,
        moe: Annotated[MoELowering, typer.Option(
            help="ort, mixture-of-experts models: auto (per-expert MatMuls up to 32 experts, else ONNX Runtime's "
                 "MoE operator), standard (per-expert MatMuls) or ort (com.microsoft.MoE).")] = MoELowering.auto,
        quality_target: Annotated[float, typer.Option(
            help="--quant: raise the most sensitive layers (measured on calibration prompts) until llmc verify's "
                 "top-1 agreement with the model reaches this and the golden prompt's answer is the model's (0: every "
                 "layer at --quant).")] = 0.99,
        quality_bytes: Annotated[float, typer.Option(
            help="--quant: the raised layers may take the weight bytes per decode step up to this many times those "
                 "with every layer at --quant.")] = 1.15,
        allow_divergence: Annotated[bool, typer.Option(
            "--allow-divergence", help="Keep an engine whose greedy continuation of the golden prompt leaves the "
                                       "model's (refused by default).")] = False,
        precision: Annotated[str, typer.Option(help="trt: engine precision.")] = "fp16",
        max_batch_size: Annotated[int | None, typer.Option(help="trt: most sequences per run.")] = None,
        max_input_len: Annotated[int | None, typer.Option(help="trt: most prompt tokens per row in a prefill.")]
        = None,
        max_seq_len: Annotated[int | None, typer.Option(help="trt: KV positions per sequence.")] = None,
        max_num_tokens: Annotated[int | None, typer.Option(help="trt: most new tokens per row in a decode run.")]
        = None,
        force: Annotated[bool, typer.Option("--force", help="Overwrite a non-empty output folder.")] = False,
    ) -> None:
        """Build an engine from an export (its own manifest points back at the export)."""
        from llmc.engines.builders import BuildConfig, build
        from llmc.progress import ConsoleSteps

        _refuse_trt_only(backend, {"--precision": None if precision == "fp16" else precision,
                                   "--max-batch-size": max_batch_size, "--max-input-len": max_input_len,
                                   "--max-seq-len": max_seq_len, "--max-num-tokens": max_num_tokens})
        ort_attention = choice(Attention, attention or "auto", "--attention") if backend is not Backend.trt else \
            Attention.auto
        cfg = BuildConfig(export_dir, out, backend.value, quant, threads, force, kv_layout=kv_layout,
                          attention=ort_attention, block_size=block_size, accuracy_level=accuracy_level,
                          quant_scheme=quant_scheme, kv_dtype=kv_dtype, matmul=matmul, moe=moe, dtype=dtype,
                          allow_divergence=allow_divergence, quality_target=quality_target,
                          quality_bytes=quality_bytes, kv_paged=kv_paged)
        if backend is Backend.trt:
            from llmc.engines.trt.build import trt_config_from
            from llmc.engines.trt.profiles import TrtLimits

            given = (max_batch_size, max_input_len, max_seq_len, max_num_tokens)
            def pick(value: int | None, default: int) -> int:
                return default if value is None else value

            limits = None if all(v is None for v in given) else TrtLimits(
                max_batch_size=pick(max_batch_size, 8), max_input_len=pick(max_input_len, 512),
                max_seq_len=pick(max_seq_len, 2048), max_num_tokens=max_num_tokens)
            manifest = build(trt_config_from(cfg, limits, precision, attention or "plugin"), ConsoleSteps(8))
        else:
            searched = cfg.quant is not Quant.none and cfg.quality_target > 0  # + the sensitivity step
            manifest = build(cfg, ConsoleSteps(6 if searched else 5))
        parity = manifest.settings.parity
        typer.echo(f"built {manifest.backend} engine ({manifest.precision}) in {out}; golden check: top-1 "
                   f"{parity.get('top1_agreement', float('nan')):.0%}, max |logit diff| "
                   f"{parity.get('max_abs_diff', float('nan')):.2e}")


def _refuse_trt_only(backend: Backend, flags: dict[str, object]) -> None:
    """TensorRT's flags (None: not given) would be dropped without a word by another backend."""
    from llmc.errors import InputError

    given = [f"{name} {value}" for name, value in flags.items() if value is not None]
    if given and backend is not Backend.trt:
        raise InputError(f"{given[0]} is for --backend trt; --backend {backend.value} does not take it")
