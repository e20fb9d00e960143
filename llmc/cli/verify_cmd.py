"""`llmc verify ENGINE_DIR`: the engine against the golden outputs of its export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("verify")
    @wrap
    def verify_command(
        engine_dir: Annotated[Path, typer.Argument(help="Engine folder.")],
        min_top1: Annotated[float, typer.Option(help="Fail below this top-1 agreement (0-1).")] = 1.0,
        threads: Annotated[int, typer.Option(help="Threads (0 = physical cores).")] = 0,
    ) -> None:
        """Teacher-force the golden prompt through the engine and compare with transformers' logits."""
        from llmc.engines.base import EngineOptions
        from llmc.engines.registry import load_engine_dir
        from llmc.errors import InputError, LlmcError
        from llmc.golden import GOLDEN_FILE, Golden
        from llmc.runtime.verify import check_golden

        if not 0.0 <= min_top1 <= 1.0:
            raise InputError(f"--min-top1 must be in [0, 1], got {min_top1}")
        engine = load_engine_dir(engine_dir, EngineOptions(threads=threads))
        result = check_golden(engine, Golden.load(engine_dir / GOLDEN_FILE))
        typer.echo(f"golden: top-1 agreement {result['top1_agreement']:.1%}, max |logit diff| "
                   f"{result['max_abs_diff']:.2e}, greedy match {int(result['greedy_match'])} tokens")
        if result["top1_agreement"] < min_top1:
            raise LlmcError(f"top-1 agreement {result['top1_agreement']:.1%} is below --min-top1 {min_top1:.1%}")
