"""The Python API: `LLM(engine_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from llmc.engines.registry import load_engine_dir
from llmc.errors import InputError
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.generator import EngineLoop, SeqUpdate
from llmc.runtime.request import RequestOutput, SamplingParams
from llmc.runtime.tokenizer import Tokenizer

Prompt = str | list[int]
Message = dict[str, Any]


LLMConfig = RuntimeConfig  # the Python API's name for it


class LLM:
    """An engine folder loaded for generation; prompts of any length mix in one batch."""

    def __init__(self, engine_dir: str | Path, config: LLMConfig | None = None) -> None:
        if not isinstance(engine_dir, str | os.PathLike):
            raise InputError(f"engine_dir must be a folder path, got {engine_dir!r:.60}", "engine_dir")
        if config is not None and not isinstance(config, LLMConfig):
            raise InputError(f"config must be an LLMConfig, got {type(config).__name__}", "config")
        config = config or LLMConfig()
        self.engine_dir = Path(engine_dir)
        self.engine = load_engine_dir(self.engine_dir, config.engine_options())
        self.tokenizer = Tokenizer.from_dir(self.engine_dir, config.chat_template)
        self.loop = EngineLoop(self.engine, self.tokenizer, config)

    @property
    def max_context(self) -> int:
        return self.loop.max_len

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)  # the ids are checked with the request
        if not isinstance(prompt, str):
            raise InputError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                             "prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        if not isinstance(messages, list):
            raise InputError(f"a conversation must be a list of messages (dicts with a 'role'), got "
                             f"{messages!r:.60}", "messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Raw prompts (text or token ids), no chat template. Outputs are in the order of the prompts."""
        if isinstance(prompts, str) or _is_ids(prompts):
            items = [prompts]
        elif isinstance(prompts, Sequence) and not isinstance(prompts, bytes | bytearray):
            items = list(prompts)  # type: ignore[arg-type]
        else:
            raise InputError(f"prompts must be a string, a list of token ids, or a list of those, got "
                             f"{type(prompts).__name__}", "prompt")
        return self._run_all([self.encode(p) for p in items], params,  # type: ignore[arg-type]
                             [p if isinstance(p, str) else None for p in items])

    def chat(self, conversations: list[Message] | list[list[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the model's chat template is applied."""
        if not isinstance(conversations, list):
            raise InputError(f"conversations must be a list of messages (dicts with a 'role') or a list of such "
                             f"lists, got {type(conversations).__name__}", "messages")
        # (no messages at all is one empty conversation, refused as generate refuses an empty prompt)
        convs = [conversations] if not conversations or isinstance(conversations[0], dict) else conversations
        return self._run_all([self.encode_chat(c) for c in convs], params, [None] * len(convs))  # type: ignore[arg-type]

    def _run_all(self, prompt_ids: list[list[int]], params: SamplingParams | Sequence[SamplingParams] | None,
                 texts: list[str | None]) -> list[RequestOutput]:
        plist = _params_list(params, len(prompt_ids))
        for ids, p in zip(prompt_ids, plist):  # validate all before running any: no lost work
            self.loop.check_request(ids, p)
        rids = [self.loop.add_request(ids, p) for ids, p in zip(prompt_ids, plist)]
        while self.loop.has_work:
            self.loop.step()
        outs = [self.loop.pop(r) for r in rids]
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Iterator[SeqUpdate]:
        """Generate one prompt, yielding each step's new text (UTF-8 safe, stop strings held back)."""
        if not isinstance(prompt_ids, list):
            raise InputError(f"stream takes a prompt's token ids (llm.encode(text) makes them), got "
                             f"{type(prompt_ids).__name__}", "prompt")
        rid = self.loop.add_request(prompt_ids, SamplingParams() if params is None else params)
        try:
            while self.loop.has_work:
                for update in self.loop.step():
                    if update.request_id == rid:
                        yield update
        finally:
            self.loop.forget(rid)


def _is_ids(x: object) -> bool:
    """One prompt of token ids, not a list of prompts: a list of anything but strings and lists (a non-integer among
    them is refused naming it, with the request's other checks)."""
    return isinstance(x, list) and (not x or not isinstance(x[0], str | list))


def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, list | tuple):
        raise InputError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}", "params")
    if len(params) != n:
        raise InputError(f"got {len(params)} SamplingParams for {n} prompts", "params")
    return list(params)
