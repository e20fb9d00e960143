"""Plans each step: which sequences decode, which prompts (or prompt chunks) run. Knows no backend.

Admission is by free KV slot and a per-step token budget; a prompt larger than what is left of the budget is run
in chunks over several steps, so running sequences keep decoding meanwhile. Finished and aborted sequences leave
at once and their slot is reused.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmc.runtime.kv_allocator import SlotAllocator
from llmc.runtime.request import FinishReason
from llmc.runtime.sequence import Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int
    max_len: int  # tokens one slot holds
    max_step_tokens: int = 2048  # per-step token budget (decode tokens + prompt tokens)
    min_chunk: int = 32  # a prompt chunk smaller than this waits for the next step
    # A prompt longer than this is prefilled whole, never in chunks (0: any prompt may be chunked). For longrope
    # models: their rotary table depends on how far a forward call reaches, so a chunk ending before the threshold
    # would rotate differently from transformers' one-call prefill.
    whole_prompts_over: int = 0

    def __post_init__(self) -> None:
        assert self.max_step_tokens >= self.max_running, "RuntimeConfig checks the budget"

    @property
    def chunk_floor(self) -> int:
        """The smallest prompt chunk worth a step, capped so that a chunk always fits beside a full decode batch:
        otherwise a prompt longer than the budget could wait for ever (min_chunk > max_step_tokens)."""
        return max(1, min(self.min_chunk, self.max_step_tokens - self.max_running + 1))


@dataclass
class StepPlan:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens) into empty slots
    extend: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens) of later prompt chunks
    decode: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.extend or self.decode)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.slots = SlotAllocator(config.max_running, config.max_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan(decode=[s for s in self.running if s.prompt_done])
        budget = self.config.max_step_tokens - len(plan.decode)
        for seq in self.running:
            if not seq.prompt_done and budget >= min(self.config.chunk_floor, self._left(seq)):
                n = min(self._left(seq), budget)
                plan.extend.append((seq, n))
                budget -= n
        while self.waiting and self.slots.free and budget >= self._first_chunk(self.waiting[0], plan):
            seq = self.waiting.popleft()
            seq.slot = self.slots.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = len(seq.prompt_ids) if self._whole(seq) else min(len(seq.prompt_ids), budget)
            plan.prefill.append((seq, n))
            budget -= n
        return plan

    def _whole(self, seq: Sequence) -> bool:
        return 0 < self.config.whole_prompts_over < len(seq.prompt_ids)

    def _first_chunk(self, seq: Sequence, plan: StepPlan) -> int:
        """The budget a waiting prompt needs to start: a chunk's floor, or all of it when it must run whole (then
        0 when no other prompt is planned: a prompt over the budget still runs, beside the decoding sequences)."""
        if not self._whole(seq):
            return min(self.config.chunk_floor, len(seq.prompt_ids))
        return 0 if not (plan.prefill or plan.extend) else len(seq.prompt_ids)

    @staticmethod
    def _left(seq: Sequence) -> int:
        return len(seq.prompt_ids) - seq.prefilled

    def release(self, seq: Sequence) -> tuple[int, int] | None:
        """Remove a finished sequence; returns a slot move (src, dst) the KV memory must follow."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return None
        self.running.remove(seq)
        move = self.slots.release(seq.slot)
        seq.slot = -1
        if move is not None:
            src, dst = move
            for other in self.running:
                if other.slot == src:
                    other.slot = dst
        return move

    def abort(self, request_id: str) -> list[Sequence]:
        """Mark every sequence of a request aborted; the loop releases them at its next step."""
        hit = [s for s in (*self.waiting, *self.running) if s.request_id == request_id and not s.finished]
        for seq in hit:
            seq.finish(FinishReason.ABORT)
        return hit
