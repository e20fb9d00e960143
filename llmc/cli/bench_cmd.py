"""`llmc bench ENGINE_DIR` (engine) and `llmc bench --serve URL` (a running server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmc.cli.common import Threads
from llmc.errors import InputError

if TYPE_CHECKING:
    from llmc.bench.engine_bench import BenchConfig


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"{flag} takes comma-separated integers, got {text!r}") from None


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("bench")
    @wrap
    def bench_command(
        engine_dir: Annotated[Path | None, typer.Argument(help="Engine folder (omit with --serve).")] = None,
        batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8",
        prompt_len: Annotated[int, typer.Option(help="Prompt tokens.")] = 128,
        new_tokens: Annotated[int, typer.Option(help="Generated tokens (EOS ignored).")] = 128,
        contexts: Annotated[str, typer.Option(help="Extra batch-1 prompt lengths, e.g. 128,512,2048.")] = "",
        threads: Threads = 0,
        repeat: Annotated[int, typer.Option(help="Timed runs per configuration (the median is reported).")] = 3,
        bandwidth_gbs: Annotated[float, typer.Option(help="Memory bandwidth of this machine.")] = 35.0,
        compare_torch: Annotated[bool, typer.Option("--compare-torch", help="Also run transformers.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line and configuration.")] = False,
        plot: Annotated[Path | None, typer.Option(help="Draw decode tokens/s vs batch and context to a PNG.")] = None,
        serve: Annotated[str | None, typer.Option(help="Benchmark a running server at this URL instead.")] = None,
        concurrency: Annotated[str, typer.Option(help="--serve: comma-separated concurrency levels.")] = "1,8,32",
        num_prompts: Annotated[int, typer.Option(help="--serve: requests per level.")] = 32,
        request_rate: Annotated[float, typer.Option(help="--serve: Poisson rate (req/s); 0 = as fast as allowed.")] = 0.0,
        output: Annotated[Path | None, typer.Option(help="--serve: save results as JSON.")] = None,
        peer: Annotated[str | None, typer.Option(
            help="--serve: a second server's URL (e.g. llama.cpp's llama-server), loaded the same way in interleaved "
                 "rounds (--repeat) at each level: both servers' figures and llmc's ratios.")] = None,
        against: Annotated[Path | None, typer.Option(
            help="A second engine folder, run right after ENGINE_DIR in every round: both engines' rows and the "
                 "ratios between them.")] = None,
        json_schema: Annotated[Path | None, typer.Option(
            help="A JSON schema file: every configuration also runs constrained to it, and the ratio of its decode "
                 "speed to the plain run's is reported (pick a schema with long answers).")] = None,
    ) -> None:
        """Measure TTFT, TPOT, ITL, decode tokens/s and peak memory against the bandwidth limit."""
        if serve is not None:
            from llmc.cli.bench_serve import bench_serve

            engine_only = {"ENGINE_DIR": engine_dir, "--against": against, "--json-schema": json_schema,
                           "--plot": plot, "--compare-torch": compare_torch or None, "--contexts": contexts or None}
            given = [name for name, value in engine_only.items() if value is not None]
            if given:
                raise InputError(f"{given[0]} is for an engine folder's benchmark, not --serve URL's")
            bench_serve(serve, _ints(concurrency, "--concurrency"), num_prompts, prompt_len, new_tokens,
                        request_rate, output, as_json, peer, repeat if peer is not None else 1)
            return
        if engine_dir is None:
            raise InputError("pass an ENGINE_DIR (or --serve URL)")
        if peer is not None:
            raise InputError("--peer compares servers: use it with --serve URL (--against compares engine folders)")
        from llmc.bench.engine_bench import BenchConfig
        from llmc.cli.common import read_json_schema

        if plot is not None:
            _check_plot(plot)

        cfg = BenchConfig(engine_dir, _ints(batch_sizes, "--batch-sizes"), prompt_len, new_tokens,
                          _ints(contexts, "--contexts"), threads, bandwidth_gbs, repeat, against,
                          read_json_schema(json_schema) if json_schema is not None else None)
        _bench_engine(cfg, compare_torch, as_json, plot)


def _check_plot(path: Path) -> None:
    """--plot's file, before the benchmark: a folder to write it in, and a format matplotlib writes."""
    from llmc.outdir import check_out_file

    check_out_file(path, "--plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return  # llmc.bench.plot names the package to install
    formats = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix and path.suffix[1:].lower() not in formats:
        raise InputError(f"--plot {path}: matplotlib writes {', '.join(sorted(formats))} files, not {path.suffix}")


def _bench_engine(cfg: BenchConfig, compare_torch: bool, as_json: bool, plot: Path | None) -> None:
    from rich.console import Console
    from rich.progress import Progress

    from llmc.bench.engine_bench import run_bench, summary_line

    cfg.check()
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as bar:
        what = "benchmarking (and transformers after each run)" if compare_torch else "benchmarking"
        task = bar.add_task(what, total=len(cfg.runs()) * cfg.repeat)
        results = run_bench(cfg, on_progress=lambda: bar.advance(task), compare_torch=compare_torch)
    for r in results:
        typer.echo(json.dumps(r) if as_json else summary_line(r) + _torch_note(r))
    if results and not as_json and "read_bandwidth_gbs" in results[0]:
        typer.echo(_bandwidth_note(results[0]["read_bandwidth_gbs"], cfg.bandwidth_gbs, results[0]["threads"]))
    if plot is not None:
        from llmc.bench.plot import plot as draw

        draw(results, plot, cfg.prompt_len)
        console.print(f"plot written to {plot}")


def _torch_note(r: dict[str, Any]) -> str:
    if "speedup_vs_torch" not in r:
        return ""
    return f"  | transformers {r['torch_decode_tok_s_per_seq']} tok/s/seq: {r['speedup_vs_torch']}x"


def _bandwidth_note(measured: list[float | None], assumed: float, threads: int) -> str:
    figures = ", ".join("n/a" if gbs is None else f"{gbs:.1f}" for gbs in measured)
    return (f"limits use {assumed:g} GB/s (--bandwidth-gbs); this machine read {figures} GB/s before the first round "
            f"and after each ({threads} threads reading 512 MiB: llmc's read kernel, or ONNX Runtime's ReduceSum over "
            "256 MiB where llmc's operators are not built); \"as measured\": the median round against the bandwidth "
            "read around it")
