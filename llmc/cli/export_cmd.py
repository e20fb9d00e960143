"""`llmc export MODEL -o OUT_DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from llmc.cli.common import Dtype


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("export")
    @wrap
    def export_command(
        model: Annotated[str, typer.Argument(help="Hugging Face folder, .gguf file, or 'smollm2-135m-instruct'.")],
        out: Annotated[Path, typer.Option("-o", "--out", help="Output folder.")],
        dtype: Annotated[Dtype, typer.Option(help="Weights and compute dtype.")] = Dtype.float32,
        opset: Annotated[int, typer.Option(help="ONNX opset (17-21).")] = 17,
        force: Annotated[bool, typer.Option("--force", help="Overwrite a non-empty output folder.")] = False,
        allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Trust .bin/.pt pickle weights.")] = False,
    ) -> None:
        """Export MODEL to prefill.onnx + decode.onnx (weights stored once), llmc.json and golden outputs."""
        from llmc.pipeline import require_export_extra
        from llmc.progress import ConsoleSteps

        require_export_extra()
        from llmc.export.exporter import STEPS, ExportConfig, export

        manifest = export(ExportConfig(model, out, dtype.value, opset, force, allow_pickle), ConsoleSteps(STEPS))
        p = manifest.parity
        exact = (f"; {p['float64_diff']:.2e} vs its float64 logits, where its own fp32 ones are "
                 f"{p['transformers_fp32_error']:.2e} from them" if "float64_diff" in p else "")
        typer.echo(f"exported {manifest.model_name} to {out} (max |logit diff| vs transformers "
                   f"{p['max_abs_diff']:.2e}{exact}, greedy match {int(p['greedy_match'])} tokens)")
