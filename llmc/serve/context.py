"""What every endpoint needs: the engine, the tokenizer, the served name, the metrics, and shared checks."""

from __future__ import annotations

from functools import lru_cache

from llmc.runtime.async_engine import AsyncEngine
from llmc.runtime.request import MAX_LOGPROBS, SamplingParams
from llmc.runtime.structured import Constraint
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.tool_calls import ToolFormat
from llmc.serve.errors import ApiError
from llmc.serve.generation import Generation
from llmc.serve.metrics import ServerMetrics
from llmc.serve.protocol import PromptTokensDetails, SamplingFields, Usage


class Served:
    """One model served: engine, tokenizer and metrics under a name."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, root: str | None,
                 tool_format: ToolFormat | None = None) -> None:
        self.engine = engine
        self.tool_format = tool_format  # None: the chat template's
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.root = root
        self.metrics = ServerMetrics(engine, model_name)
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check(self, req: SamplingFields) -> None:
        """Checks shared by both endpoints, before any tokenizing."""
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")

    def compile_constraint(self, fields: dict[str, object]) -> None:
        """Compile (or find cached) a request's constraint; run it in a worker thread: a large schema takes a
        while, and the first one builds the tokenizer's token table."""
        constraint = Constraint.of(fields.get("json_schema"), fields.get("regex"), fields.get("grammar"),  # type: ignore[arg-type]
                                   fields.get("constraint_param"))  # type: ignore[arg-type]
        if constraint is not None:
            self.engine.loop.grammars.check(constraint)

    def check_logprobs(self, value: int | None, name: str) -> None:
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ApiError(400, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)

    def encode(self, text: str, req: SamplingFields, add_special_tokens: bool) -> list[int]:
        """A prompt's ids, its last `truncate_prompt_tokens` when asked (never truncated otherwise); one that cannot
        fit the context is refused before its ids are listed."""
        k = req.truncate_prompt_tokens
        limit = self.max_model_len if k is None else None
        return self.prompt_ids(self.tokenizer.encode(text, add_special_tokens=add_special_tokens, limit=limit), req)

    def prompt_ids(self, ids: list[int], req: SamplingFields) -> list[int]:
        """Keep the last `truncate_prompt_tokens` tokens when asked; never truncate otherwise."""
        k = req.truncate_prompt_tokens
        return ids[-k:] if k is not None and len(ids) > k else ids

    def default_max_tokens(self, prompts: list[list[int]]) -> int:
        """What is left of the context after the longest prompt (at least 1: a too-long prompt fails later)."""
        return max(1, self.max_model_len - max(len(p) for p in prompts))

    def start(self, prompts: list[list[int]], params: SamplingParams) -> Generation:
        """Queue the request's sequences. One that needs more sequences than the server can ever hold is a 400
        (429 is for load: retrying would never help it)."""
        needed, capacity = len(prompts) * params.n, self.engine.capacity
        if needed > capacity:
            what = f"{len(prompts)} prompts x n={params.n}" if len(prompts) > 1 else f"n={params.n}"
            raise ApiError(400, f"the request needs {needed} sequences ({what}); this server holds at most "
                                f"{capacity} (max running {self.engine.loop.max_running} + max queue "
                                f"{self.engine.config.max_queue})", param="n" if len(prompts) == 1 else "prompt")
        return Generation(self.engine, prompts, params, self.metrics.tracker())

    @staticmethod
    def usage(gen: Generation) -> Usage:
        return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                     total_tokens=gen.prompt_tokens + gen.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.cached_tokens))
