"""One generated sequence: its tokens, sampling state, stop checks and streaming text."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from llmc.runtime.block_manager import BlockTable
from llmc.runtime.request import FinishReason, SamplingParams, TokenLogprob
from llmc.runtime.sampler import SequenceSamplingState
from llmc.runtime.stopping import StopChecker
from llmc.runtime.tokenizer import DecodeStream


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One generated sequence: the single owner of its state. Its tokens are its sampling state's list (the sampler
    records each token it chooses there), its text and finish reason are here; the stop checker holds only the
    text it holds back, the scheduler only the slot it gave (`slot`)."""

    seq_id: str
    request_id: str
    index: int  # which of the request's n completions
    prompt_ids: list[int]
    params: SamplingParams
    sampling: SequenceSamplingState
    stopper: StopChecker
    detok: DecodeStream | None
    status: Status = Status.WAITING
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the KV cache (chunked prefill, a cached prefix)
    table: BlockTable | None = None  # its KV blocks while it runs
    recompute: int = 0  # generated tokens to compute again with the prompt (after a preemption)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    text: str = ""
    new_text: str = ""  # emitted by the latest step, for streaming
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: Exception | None = None  # what ended it with FinishReason.ERROR, when known (an InputError: the request's fault)

    @property
    def output_ids(self) -> list[int]:
        return self.sampling.generated

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_len(self) -> int:
        """Tokens to compute before the next is sampled: the prompt, and after a preemption what it generated."""
        return len(self.prompt_ids) + self.recompute

    @property
    def prompt_done(self) -> bool:
        return self.prefilled >= self.prefill_len

    @property
    def kv_len(self) -> int:
        """Tokens in its KV memory: the prefill so far, then all but the newest token (fed at the next decode)."""
        return self.prefilled if not self.prompt_done else self.num_tokens - 1

    def accept(self, logprob: TokenLogprob | None) -> None:
        """Take the token the sampler just recorded: its logprob, its text (held back near stop strings), and
        whether it ends the sequence."""
        assert not self.finished and self.output_ids, f"{self.seq_id}: accept without a new token"
        token = self.output_ids[-1]
        if logprob is not None:
            self.logprobs.append(logprob)
        piece = self.detok.step(token) if self.detok is not None else ""
        emitted, reason = self.stopper.on_token(token, piece, len(self.output_ids))
        grammar = self.sampling.grammar
        if reason is None and grammar is not None and grammar.done:  # the constraint allows nothing more
            emitted, reason = emitted + self.stopper.flush(), FinishReason.STOP
        self.new_text = emitted
        self.text += emitted
        if reason is not None:
            self.finish(reason)

    def finish(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
        self.status = Status.FINISHED
