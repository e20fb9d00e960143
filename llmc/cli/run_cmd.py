"""`llmc run ENGINE_DIR|MODEL [PROMPT]`: one answer streamed, or an interactive chat."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from llmc.runtime.request import SamplingParams


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("run")
    @wrap
    def run_command(
        model: Annotated[str, typer.Argument(help="Engine folder, export folder, or a model (exported on first use).")],
        prompt: Annotated[str | None, typer.Argument(help="Prompt; without it, an interactive chat.")] = None,
        raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
        system: Annotated[str | None, typer.Option(help="System prompt (chat template).")] = None,
        chat_template: Annotated[Path | None, typer.Option(help="Jinja chat template file.")] = None,
        max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 256,
        temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
        top_k: Annotated[int, typer.Option(help="0 = off.")] = 0,
        top_p: Annotated[float, typer.Option(help="Nucleus sampling, in (0, 1].")] = 1.0,
        min_p: Annotated[float, typer.Option(help="Min-p sampling, in [0, 1].")] = 0.0,
        repetition_penalty: Annotated[float, typer.Option(help="> 0; 1 = off.")] = 1.0,
        seed: Annotated[int | None, typer.Option(help="Same seed, same output.")] = None,
        stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
        threads: Annotated[int, typer.Option(help="Threads (0 = physical cores).")] = 0,
        kv_budget_mb: Annotated[int, typer.Option(help="Memory for the KV cache.")] = 1024,
    ) -> None:
        """Generate with an engine, streaming text as it comes."""
        from llmc.pipeline import ensure_engine
        from llmc.progress import ConsoleSteps
        from llmc.runtime.llm import LLM, LLMConfig

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=list(stop or []))
        params.validate()
        engine_dir = ensure_engine(model, ConsoleSteps(8, prefix="setup "))
        llm = LLM(engine_dir, LLMConfig(threads=threads, max_batch=1, kv_budget_mb=kv_budget_mb,
                                        chat_template=str(chat_template) if chat_template else None))
        if prompt is not None:
            messages = _messages(system, prompt)
            ids = llm.encode(prompt) if raw else llm.encode_chat(messages)
            _stream(llm, ids, params)
        else:
            _chat(llm, system, params)


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


def _chat(llm: Any, system: str | None, params: SamplingParams) -> None:
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
        answer = _stream(llm, llm.encode_chat(messages), params)
        messages.append({"role": "assistant", "content": answer})
