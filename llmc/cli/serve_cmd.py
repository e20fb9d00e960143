"""`llmc serve ENGINE_DIR|MODEL`: an OpenAI-compatible HTTP server; `llmc serve-bench URL`: load it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

from llmc.cli.common import ChatTemplate, KVBudgetMB, Threads
from llmc.runtime.config import SERVE_STEP_TOKENS
from llmc.runtime.tool_calls import ToolFormat
from llmc.serve.logs import LogLevel


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("serve")
    @wrap
    def serve_command(
        model: Annotated[str, typer.Argument(help="Engine folder, export folder, or a model (exported on first use).")],
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
        max_running: Annotated[int, typer.Option(help="Most sequences decoding together (a cap: engines with "
                                                     "paged KV memory admit while KV blocks are free).")] = 8,
        max_queue: Annotated[int, typer.Option(help="Sequences waiting beyond those; past it: 429.")] = 64,
        kv_budget_mb: KVBudgetMB = 1024,
        kv_block_size: Annotated[int, typer.Option(help="Tokens per KV block (paged engines).")] = 64,
        prefix_caching: Annotated[bool, typer.Option(help="Reuse the KV blocks of a prompt prefix computed "
                                                          "before (paged engines).")] = True,
        max_step_tokens: Annotated[int, typer.Option(
            help="Tokens per engine step (prompt chunks + decode).")] = SERVE_STEP_TOKENS,
        kv_prefault: Annotated[bool, typer.Option(help="Map and zero the whole KV budget at start-up: the memory is "
                                                      "held from the start, and no page faults land in the first "
                                                      "requests' steps.")] = True,
        threads: Threads = 0,
        chat_template: ChatTemplate = None,
        shutdown_timeout: Annotated[float, typer.Option(help="Seconds to drain requests on SIGTERM.")] = 30.0,
        served_model_name: Annotated[str | None, typer.Option(help="Name clients pass as `model`.")] = None,
        log_level: Annotated[LogLevel, typer.Option(help="Log level (uvicorn's and llmc's lines).")] = LogLevel.info,
        api_key: Annotated[str | None, typer.Option(
            envvar="LLMC_API_KEY", show_envvar=True,
            help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise).")] = None,
        protect_metrics: Annotated[bool, typer.Option(help="Put /metrics behind the API key too.")] = False,
        allowed_origins: Annotated[str, typer.Option(
            help="CORS: comma-separated origins allowed to call the API from a browser ('*' for any); "
                 "off when empty.")] = "",
        max_request_bytes: Annotated[int, typer.Option(help="Largest request body; larger ones get 413.")]
        = 2 * 2**20,
        tool_call_parser: Annotated[ToolFormat | None, typer.Option(
            help="The model's tool call format (default: the one its chat template uses).")] = None,
    ) -> None:
        """Serve an engine over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
        from llmc.pipeline import ensure_engine
        from llmc.progress import ConsoleSteps
        from llmc.runtime.config import RuntimeConfig
        from llmc.serve.app import ServeConfig
        from llmc.serve.server import run_server

        _check_flags(max_queue, port, shutdown_timeout, max_request_bytes, api_key)
        runtime = RuntimeConfig(threads=threads, max_running=max_running, kv_budget_mb=kv_budget_mb,
                                max_step_tokens=max_step_tokens, kv_block_size=kv_block_size,
                                prefix_caching=prefix_caching, kv_prefault=kv_prefault,
                                chat_template=str(chat_template) if chat_template else None)
        engine_dir = ensure_engine(model, ConsoleSteps(8, prefix="setup "))
        config = ServeConfig(model_name=served_model_name or _default_name(model, engine_dir), host=host,
                             port=port, runtime=runtime, max_queue=max_queue, shutdown_timeout=shutdown_timeout,
                             api_key=api_key or None, protect_metrics=protect_metrics,
                             allowed_origins=tuple(o.strip() for o in allowed_origins.split(",") if o.strip()),
                             max_request_bytes=max_request_bytes, tool_call_parser=tool_call_parser)
        run_server(engine_dir, config, log_level=log_level)

    @app.command("serve-bench", hidden=True)
    @wrap
    def serve_bench_command(
        url: Annotated[str, typer.Argument(help="Server base URL, e.g. http://127.0.0.1:8000.")],
        model: Annotated[str | None, typer.Option(help="Model name (default: the server's first).")] = None,
        num_prompts: Annotated[int, typer.Option(help="Requests to send.")] = 64,
        concurrency: Annotated[int | None, typer.Option(help="Most requests in flight.")] = None,
        request_rate: Annotated[float, typer.Option(help="Poisson arrivals per second (inf: all at once).")]
        = float("inf"),
        prompt_len: Annotated[int, typer.Option(help="Prompt length in tokens (approximate).")] = 128,
        max_tokens: Annotated[int, typer.Option(help="Tokens to generate per request.")] = 128,
        ignore_eos: Annotated[bool, typer.Option(help="Generate max_tokens whatever the model says.")] = True,
        endpoint: Annotated[str, typer.Option(help="chat or completions.")] = "chat",
        seed: Annotated[int, typer.Option(help="Seed of the arrival times.")] = 0,
        output: Annotated[Path | None, typer.Option(help="Save the results as JSON here.")] = None,
    ) -> None:
        """Load a running server like `vllm bench serve`: TTFT, TPOT, ITL, latency percentiles, throughput."""
        from llmc.bench.serve_client import BenchConfig, format_report
        from llmc.cli.bench_serve import check_load, load
        from llmc.errors import InputError

        check_load(num_prompts, prompt_len, "--max-tokens", max_tokens, output)
        if concurrency is not None and concurrency < 1:
            raise InputError(f"--concurrency must be >= 1, got {concurrency}")
        if not request_rate > 0:
            raise InputError(f"--request-rate must be > 0 (inf: all at once), got {request_rate}")
        if endpoint not in ("chat", "completions"):
            raise InputError(f"--endpoint must be chat or completions, got {endpoint!r}")
        cfg = BenchConfig(url=url, model=model, num_prompts=num_prompts, concurrency=concurrency,
                          request_rate=request_rate, prompt_len=prompt_len, max_tokens=max_tokens,
                          ignore_eos=ignore_eos, endpoint=endpoint, seed=seed, output=output)
        typer.echo(format_report(load(cfg)))


def _check_flags(max_queue: int, port: int, shutdown_timeout: float, max_request_bytes: int,
                 api_key: str | None) -> None:
    from llmc.errors import InputError

    if max_request_bytes < 1024:
        raise InputError(f"--max-request-bytes must be >= 1024, got {max_request_bytes}")
    if api_key is not None and (not api_key.strip() or not api_key.isascii() or not api_key.isprintable()):
        raise InputError("--api-key (or LLMC_API_KEY) must be printable ASCII and not empty")

    if max_queue < 0:
        raise InputError(f"--max-queue must be >= 0, got {max_queue}")
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be in [0, 65535], got {port}")
    if not 0 <= shutdown_timeout < math.inf:
        raise InputError(f"--shutdown-timeout must be >= 0 and finite, got {shutdown_timeout}")


def _default_name(ref: str, engine_dir: Path) -> str:
    """The name the user typed for a model reference; the folder's name for an engine or export folder."""
    path = Path(ref).expanduser()
    return path.resolve().name if path.exists() else ref
