"""`llmc build EXPORT_DIR --backend ort -o ENGINE_DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from llmc.cli.common import Backend, Quant


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("build")
    @wrap
    def build_command(
        export_dir: Annotated[Path, typer.Argument(help="A folder written by `llmc export`.")],
        out: Annotated[Path, typer.Option("-o", "--out", help="Engine folder.")],
        backend: Annotated[Backend, typer.Option(help="ort: ONNX Runtime CPU; trt: TensorRT (NVIDIA GPU).")] = Backend.ort,
        quant: Annotated[Quant, typer.Option(help="Weight-only quantization (ort).")] = Quant.none,
        threads: Annotated[int, typer.Option(help="Threads recorded for the engine (0 = physical cores).")] = 0,
        force: Annotated[bool, typer.Option("--force", help="Overwrite a non-empty output folder.")] = False,
    ) -> None:
        """Build an engine from an export (its own manifest points back at the export)."""
        from llmc.engines.builders import BuildConfig, build
        from llmc.progress import ConsoleSteps

        manifest = build(BuildConfig(export_dir, out, backend.value, quant.value, threads, force), ConsoleSteps(5))
        parity = manifest.settings.get("parity", {})
        typer.echo(f"built {manifest.backend} engine ({manifest.precision}) in {out}; golden check: top-1 "
                   f"{parity.get('top1_agreement', float('nan')):.0%}, max |logit diff| "
                   f"{parity.get('max_abs_diff', float('nan')):.2e}")
