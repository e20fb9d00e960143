"""The Python API: `LLM(engine_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from llmc.engines.registry import load_engine_dir
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
        config = config or LLMConfig()
        self.engine_dir = Path(engine_dir)
        self.engine = load_engine_dir(self.engine_dir, config.engine_options())
        self.tokenizer = Tokenizer.from_dir(self.engine_dir, config.chat_template)
        self.loop = EngineLoop(self.engine, self.tokenizer, config)

    @property
    def max_context(self) -> int:
        return self.loop.max_len

    def encode(self, prompt: Prompt) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=True)

    def encode_chat(self, messages: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Raw prompts (text or token ids), no chat template. Outputs are in the order of the prompts."""
        items = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        return self._run_all([self.encode(p) for p in items], params,  # type: ignore[arg-type]
                             [p if isinstance(p, str) else None for p in items])

    def chat(self, conversations: list[Message] | list[list[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the model's chat template is applied."""
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
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
        rid = self.loop.add_request(prompt_ids, params or SamplingParams())
        try:
            while self.loop.has_work:
                for update in self.loop.step():
                    if update.request_id == rid:
                        yield update
        finally:
            self.loop.forget(rid)


def _is_ids(x: object) -> bool:
    return isinstance(x, list) and (not x or isinstance(x[0], int))


def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        from llmc.errors import InputError

        raise InputError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
