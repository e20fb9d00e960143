"""`llmc run ENGINE_DIR|MODEL [PROMPT]`: one answer streamed, or an interactive chat;
`--input prompts.jsonl --output results.jsonl`: an offline batch on the same engine loop."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from llmc.cli.common import ChatTemplate, KVBudgetMB, Threads
from llmc.errors import InputError
from llmc.runtime.request import SamplingParams

if TYPE_CHECKING:
    from llmc.runtime.batch_file import BatchConfig


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("run")
    @wrap
    def run_command(
        model: Annotated[str, typer.Argument(help="Engine folder, export folder, or a model (exported on first use).")],
        prompt: Annotated[str | None, typer.Argument(help="Prompt; without it, an interactive chat.")] = None,
        raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
        system: Annotated[str | None, typer.Option(help="System prompt (chat template).")] = None,
        chat_template: ChatTemplate = None,
        max_tokens: Annotated[int | None, typer.Option(help="Most tokens to generate [default: 256, or what the "
                                                        "context leaves].")] = None,
        temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
        top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
        top_p: Annotated[float, typer.Option(help="Nucleus sampling, in (0, 1].")] = 1.0,
        min_p: Annotated[float, typer.Option(help="Min-p sampling, in [0, 1].")] = 0.0,
        repetition_penalty: Annotated[float, typer.Option(help="> 0; 1 = off.")] = 1.0,
        seed: Annotated[int | None, typer.Option(help="Same seed, same output.")] = None,
        stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
        threads: Threads = 0,
        kv_budget_mb: KVBudgetMB = 1024,
        input_file: Annotated[Path | None, typer.Option("--input", help="JSONL of prompts: an offline batch "
                                                        "(lines {\"prompt\"} or {\"messages\"}, sampling fields).")] = None,
        output_file: Annotated[Path | None, typer.Option("--output", help="JSONL of results, in input order "
                                                         "(with --input); an interrupted run resumes.")] = None,
        force: Annotated[bool, typer.Option("--force", help="With --output: replace an existing results file.")]
        = False,
        max_running: Annotated[int, typer.Option(help="With --input: sequences decoding together.")] = 8,
        json_schema: Annotated[Path | None, typer.Option(
            help="A JSON schema file: the answer is JSON that matches it (constrained decoding).")] = None,
        regex: Annotated[str | None, typer.Option(help="The answer matches this regular expression.")] = None,
        grammar: Annotated[Path | None, typer.Option(
            help="A grammar file (Lark or GBNF): the answer is a sentence of it.")] = None,
    ) -> None:
        """Generate with an engine, streaming text as it comes; or run a JSONL file of prompts (--input)."""
        from llmc.pipeline import ensure_engine
        from llmc.progress import ConsoleSteps
        from llmc.runtime.config import RuntimeConfig
        from llmc.runtime.llm import LLM

        params = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=list(stop or []),
                                **_constraint(json_schema, regex, grammar))
        params.validate()
        batch = _batch_config(prompt, input_file, output_file, params, force)
        _check_prompt_flags(prompt, raw, system, batch is not None)
        runtime = RuntimeConfig(threads=threads, max_running=max_running if batch else 1, kv_budget_mb=kv_budget_mb,
                                chat_template=str(chat_template) if chat_template else None)
        engine_dir = ensure_engine(model, ConsoleSteps(8, prefix="setup "))
        llm = LLM(engine_dir, runtime)
        if batch is not None:
            _run_batch(llm, batch)
            return
        if prompt is not None:
            messages = _messages(system, prompt)
            ids = llm.encode(prompt) if raw else llm.encode_chat(messages)
            _stream(llm, ids, _fit(llm, ids, params, max_tokens is None))
        else:
            _chat(llm, system, params, max_tokens is None)


def _constraint(json_schema: Path | None, regex: str | None, grammar: Path | None) -> dict[str, Any]:
    """SamplingParams' constraint fields from the flags (the schema and grammar read from their files)."""
    from llmc.cli.common import read_json_schema

    fields: dict[str, Any] = {"regex": regex}
    if json_schema is not None:
        fields["json_schema"] = read_json_schema(json_schema)
    if grammar is not None:
        try:
            fields["grammar"] = grammar.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read the grammar file {grammar}: {e}") from None
    return fields


def _batch_config(prompt: str | None, input_file: Path | None, output_file: Path | None,
                  params: SamplingParams, force: bool) -> BatchConfig | None:
    """The batch run the flags ask for (None: a single prompt or a chat); checked before an engine loads."""
    from llmc.runtime.batch_file import BatchConfig, check_paths

    if input_file is None and output_file is None:
        if force:
            raise InputError("--force replaces an existing --output file: it goes with --input and --output")
        return None
    if input_file is None or output_file is None:
        raise InputError("--input and --output go together: llmc run ENGINE --input in.jsonl --output out.jsonl")
    if prompt is not None:
        raise InputError("give either a PROMPT or --input, not both")
    config = BatchConfig(input_file, output_file, params)
    check_paths(config)
    if output_file.exists() and not force:  # the results of an earlier run
        raise InputError(f"--output {output_file} already exists; pass --force to replace it")
    return config


def _check_prompt_flags(prompt: str | None, raw: bool, system: str | None, batch: bool) -> None:
    """--raw and --system shape a PROMPT: refuse them where they would be dropped without a word."""
    if batch and (raw or system is not None):
        raise InputError("--raw and --system shape a PROMPT, not --input lines (a line gives a raw 'prompt' or "
                         "'messages', a system turn included)")
    if raw and system is not None:
        raise InputError("--system goes into the chat template, which --raw skips: give one of them")
    if raw and prompt is None:
        raise InputError("--raw needs a PROMPT: the interactive chat always applies the chat template")


def _run_batch(llm: Any, config: BatchConfig) -> None:
    from llmc.runtime.batch_file import ConsoleBatchProgress, run_batch

    try:
        with ConsoleBatchProgress() as bar:
            summary = run_batch(llm, config, bar)
    except KeyboardInterrupt:
        typer.echo(f"interrupted: finished lines are kept in {config.sidecar}; run the same command to resume",
                   err=True)
        raise typer.Exit(code=130) from None
    resumed = f", {summary.resumed} from an earlier run" if summary.resumed else ""
    typer.echo(f"wrote {summary.total} results ({summary.errors} errors{resumed}) to {config.output}", err=True)


DEFAULT_MAX_TOKENS = 256


def _fit(llm: Any, ids: list[int], params: SamplingParams, default: bool) -> SamplingParams:
    """Without an explicit --max-tokens, generate at most what the context leaves after the prompt."""
    if not default:
        return params
    return replace(params, max_tokens=max(1, min(params.max_tokens, llm.max_context - len(ids))))


def _messages(system: str | None, prompt: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _stream(llm: Any, ids: list[int], params: SamplingParams) -> str:
    text = []
    for update in llm.stream(ids, params):
        if update.text:
            sys.stdout.write(update.text)
            sys.stdout.flush()
            text.append(update.text)
    sys.stdout.write("\n")
    return "".join(text)


def _chat(llm: Any, system: str | None, params: SamplingParams, default_max: bool) -> None:
    """Interactive chat that keeps the conversation; empty line or /exit (or EOF) ends it."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    typer.echo("chat with the model; /exit or an empty line to quit", err=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip() or line.strip() == "/exit":
            break
        messages.append({"role": "user", "content": line})
        ids = llm.encode_chat(messages)
        answer = _stream(llm, ids, _fit(llm, ids, params, default_max))
        messages.append({"role": "assistant", "content": answer})
