"""`llmc verify ENGINE_DIR`: the engine against transformers' golden outputs and against the fp32 export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from llmc.cli.common import Threads


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("verify")
    @wrap
    def verify_command(
        engine_dir: Annotated[Path, typer.Argument(help="Engine folder.")],
        min_top1: Annotated[float, typer.Option(help="Fail below this top-1 agreement with the export (0-1).")] = 0.9,
        max_kl: Annotated[float | None, typer.Option(help="Fail above this mean KL divergence.")] = None,
        steps: Annotated[int, typer.Option(help="Greedy tokens per prompt of the prompt set.")] = 32,
        threads: Threads = 0,
    ) -> None:
        """Golden check, then top-1 agreement / KL / greedy match against the export over a fixed prompt set."""
        from llmc.engines.base import EngineOptions
        from llmc.engines.ort.build import export_engine
        from llmc.engines.registry import load_engine_dir
        from llmc.errors import InputError, LimitError, LlmcError
        from llmc.golden import GOLDEN_FILE, Golden
        from llmc.manifest import load_export
        from llmc.runtime.tokenizer import Tokenizer
        from llmc.runtime.verify import VERIFY_PROMPTS, check_golden, compare_engines, encode_prompt

        if not 0.0 <= min_top1 <= 1.0:
            raise InputError(f"--min-top1 must be in [0, 1], got {min_top1}")
        if max_kl is not None and not max_kl >= 0.0:
            raise InputError(f"--max-kl must be >= 0 (a KL divergence is), got {max_kl}")
        if steps < 1:
            raise InputError(f"--steps must be >= 1, got {steps}")
        engine = load_engine_dir(engine_dir, EngineOptions(threads=threads))
        prompts = [encode_prompt(Tokenizer.from_dir(engine_dir), p) for p in VERIFY_PROMPTS]
        longest = max(map(len, prompts))
        if longest + steps > engine.max_positions:  # found before minutes of decoding, not at the last position
            raise LimitError(f"--steps {steps} after the longest verify prompt ({longest} tokens) needs "
                             f"{longest + steps} positions, the engine holds {engine.max_positions}")
        golden = check_golden(engine, Golden.load(engine_dir / GOLDEN_FILE))
        typer.echo(f"golden (transformers): top-1 {golden['top1_agreement']:.1%}, max |logit diff| "
                   f"{golden['max_abs_diff']:.2e}, greedy match {int(golden['greedy_match'])} tokens")
        export_dir = Path(engine.manifest.export_dir)
        reference = export_engine(load_export(export_dir), export_dir, threads)
        r = compare_engines(reference, engine, prompts, steps, together=True)
        for label, s in ((f"vs export ({len(prompts)} prompts, {int(r['positions'])} positions)", r),
                         (f"decoded together ({len(prompts)} rows a step, as a server batches them)", r["together"])):
            typer.echo(f"{label}: top-1 agreement {s['top1_agreement']:.1%}, mean KL {s['mean_kl']:.2e}, greedy "
                       f"match mean {s['greedy_match_mean']:.1f} / min {int(s['greedy_match_min'])} of {steps} tokens")
        if engine.manifest.settings.quality:
            typer.echo(quality_line(engine.manifest.settings.quality))
        for how, s in (("", r), (" decoded together", r["together"])):
            if s["top1_agreement"] < min_top1:
                raise LlmcError(f"top-1 agreement{how} {s['top1_agreement']:.1%} is below --min-top1 {min_top1:.1%}")
            if max_kl is not None and s["mean_kl"] > max_kl:
                raise LlmcError(f"mean KL{how} {s['mean_kl']:.3e} is above --max-kl {max_kl:.3e}")



def quality_line(q: dict[str, Any]) -> str:
    """What the build's quality target chose: how many layers it raised, to what, and what that costs in bytes."""
    kinds: dict[str, int] = {}
    for precision in q["raised"].values():
        kinds[precision] = kinds.get(precision, 0) + 1
    raised = ", ".join(f"{n} to {p}" for p, n in sorted(kinds.items())) or "none"
    ratio = q["weight_bytes_per_step"] / max(1, q["base_weight_bytes_per_step"])
    return (f"precision chosen for top-1 >= {q['target']:.0%}: {len(q['raised'])} of {q['candidates']} layers raised "
            f"({raised}); {q['weight_bytes_per_step'] / 1e6:.1f} MB of weights per decode step, {ratio:.3f}x every "
            f"layer at the base precision; measured at build: top-1 {q['top1_agreement']:.1%}, greedy match mean "
            f"{q['greedy_match_mean']:.1f}")
