"""How an engine is run: one frozen config for every driver (the Python API, `llmc run`, `llmc serve`, the
benchmarks), validated once where it is made, and passed down whole (the server's config composes it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from llmc.engines.base import EngineOptions
from llmc.errors import InputError

# tokens per engine step of a server (`llmc serve`, and what `llmc package` / `llmc deploy ray` run): small prompt
# chunks keep running streams' inter-token latency low; it also bounds the sequences a server runs together
SERVE_STEP_TOKENS = 512


@dataclass(frozen=True)
class RuntimeConfig:
    threads: int = 0  # 0: physical cores
    max_running: int = 8  # sequences decoding together (KV slots)
    kv_budget_mb: int = 1024  # memory for the KV cache; the context per sequence follows from it
    max_step_tokens: int = 2048  # per-step token budget (prompt chunks + decode tokens)
    min_chunk: int = 32  # a prompt chunk smaller than this waits for the next step
    chat_template: str | None = None  # a Jinja file overriding the model's template
    prefix_caching: bool = True  # reuse the KV blocks of a cached prompt prefix (engines with paged KV memory)
    kv_block_size: int = EngineOptions.kv_block_size  # tokens per KV block (paged engines)
    # map and zero the whole KV budget when the engine loads (a server: its memory held from the start, and no page
    # faults inside the first requests' steps); off, pages are mapped as tokens first reach them
    kv_prefault: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):  # from Python any value gets here: a wrong type is named, not compared
            value, flag = getattr(self, f.name), f"--{f.name.replace('_', '-')}"
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise InputError(f"{flag} must be an integer, got {value!r}", f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise InputError(f"{f.name} must be True or False, got {value!r}", f.name)
        if self.chat_template is not None and not isinstance(self.chat_template, str | os.PathLike):
            raise InputError(f"--chat-template must be a file path, got {self.chat_template!r}", "chat_template")
        self.engine_options()  # threads and the KV budget: the engine's own checks
        for name, value in (("max_running", self.max_running), ("min_chunk", self.min_chunk)):
            if value < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {value}", name)
        if self.max_step_tokens < self.max_running:
            raise InputError(f"--max-step-tokens ({self.max_step_tokens}) must be >= --max-running "
                             f"({self.max_running}): every running sequence decodes one token per step",
                             "max_step_tokens")

    def engine_options(self) -> EngineOptions:
        return EngineOptions(threads=self.threads, kv_budget_mb=self.kv_budget_mb, kv_block_size=self.kv_block_size)
