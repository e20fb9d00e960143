"""Plans each step: which sequences decode, which prompts (or prompt chunks) run. Knows no backend.

Admission is by free KV blocks (with one block of headroom per running sequence, for their decodes), a free row
(`max_running` is a cap, not a memory reservation) and a per-step token budget; a prompt larger than what is left of
the budget is run in chunks over several steps, so running sequences keep decoding meanwhile. A prompt's longest
cached prefix is taken from the prefix cache and only the rest computed. When a decoding sequence needs a block and
none is free, the most recently admitted sequence is preempted: its blocks go back (its full blocks stay cached) and
it waits at the head of the queue to compute its prompt and output so far again, keeping that output. Finished and
aborted sequences leave at once and their row and blocks are reused.

Engines with the slot layout (each row holds `max_len` contiguous positions) are planned the same way over
`max_running` rows of ceil(max_len / block_size) blocks: no request can run out of blocks there, and no prefix is
shared.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmc.runtime.block_manager import BlockManager
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
    num_blocks: int = 0  # KV blocks shared by all rows (paged memory); 0: the slot layout (see the module)
    block_size: int = 16
    prefix_caching: bool = False  # paged memory only
    decode_headroom: int = 1  # paged memory: blocks left free per running sequence when a prompt is admitted

    @property
    def paged(self) -> bool:
        return self.num_blocks > 0

    @property
    def total_blocks(self) -> int:
        return self.num_blocks if self.paged else self.max_running * -(-self.max_len // self.block_size)

    def __post_init__(self) -> None:
        assert self.max_step_tokens >= self.max_running, "RuntimeConfig checks the budget"

    @property
    def chunk_floor(self) -> int:
        """The smallest prompt chunk worth a step, capped so that a chunk always fits beside a full decode batch:
        otherwise a prompt longer than the budget could wait for ever (min_chunk > max_step_tokens)."""
        return max(1, min(self.min_chunk, self.max_step_tokens - self.max_running + 1))


# What KV memory must do when a row is given up, in order: (src, dst) moves row src into row dst (then src is
# empty), (row, None) empties the row.
KVOp = tuple[int, int | None]


@dataclass
class StepPlan:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens) into empty slots
    extend: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens) after cached ones
    decode: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # rows taken this step (their cached prefix: prefilled)
    preempted: list[Sequence] = field(default_factory=list)
    kv_ops: list[KVOp] = field(default_factory=list)  # for the preempted rows, before the engine runs

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.extend or self.decode)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.slots = SlotAllocator(config.max_running, config.max_len)
        self.blocks = BlockManager(config.total_blocks, config.block_size, config.prefix_caching and config.paged)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._reserve_decodes(plan)
        plan.decode = [s for s in self.running if s.prompt_done]
        budget = self.config.max_step_tokens - len(plan.decode)
        for seq in self.running:
            if not seq.prompt_done and budget >= min(self.config.chunk_floor, self._left(seq)):
                n = min(self._left(seq), budget)
                plan.extend.append((seq, n))
                budget -= n
        while self.waiting and self.slots.free and budget >= self._first_chunk(self.waiting[0], plan):
            seq = self.waiting[0]
            headroom = len(self.running) * self.config.decode_headroom if self.config.paged else 0
            got = self.blocks.admit(seq.token_ids, headroom)
            if got is None:
                break
            self.waiting.popleft()
            seq.table, seq.prefilled = got
            if not seq.recompute:
                seq.cached_tokens = seq.prefilled
            seq.slot = self.slots.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.admitted.append(seq)
            n = self._left(seq) if self._whole(seq) else min(self._left(seq), budget)
            (plan.extend if seq.prefilled else plan.prefill).append((seq, n))
            budget -= n
        return plan

    def _reserve_decodes(self, plan: StepPlan) -> None:
        """A block for every decoding sequence whose next token starts one, oldest first; when none is left, the
        most recent sequence gives its blocks back (possibly the one that needed the block)."""
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or not seq.prompt_done:
                continue
            assert seq.table is not None
            while not self.blocks.can_grow(seq.table, seq.kv_len + 1):
                victim = next(s for s in reversed(self.running) if not s.finished)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq.table, seq.kv_len + 1)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        plan.kv_ops.append(self._leave(seq))
        seq.recompute = len(seq.output_ids)
        seq.prefilled = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def computed(self, seq: Sequence) -> None:
        """After an engine call wrote a sequence's tokens: name its newly full blocks for prefix reuse."""
        table = seq.table
        if self.blocks.prefix_caching and table is not None and seq.kv_len // self.config.block_size > len(table.hashes):
            self.blocks.commit(table, seq.token_ids[: seq.kv_len])

    def _whole(self, seq: Sequence) -> bool:
        return 0 < self.config.whole_prompts_over < len(seq.prompt_ids)

    def _first_chunk(self, seq: Sequence, plan: StepPlan) -> int:
        """The budget a waiting prompt needs to start: a chunk's floor, or all of it when it must run whole (then
        0 when no other prompt is planned: a prompt over the budget still runs, beside the decoding sequences)."""
        if not self._whole(seq):
            return min(self.config.chunk_floor, seq.prefill_len)
        return 0 if not (plan.prefill or plan.extend) else seq.prefill_len

    @staticmethod
    def _left(seq: Sequence) -> int:
        return seq.prefill_len - seq.prefilled

    def release(self, seq: Sequence) -> KVOp | None:
        """Remove a finished sequence; returns what the KV memory must do (None: it held no row)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return None
        return self._leave(seq)

    def _leave(self, seq: Sequence) -> KVOp:
        """Give up a running sequence's blocks and row (keeping rows 0..n-1 taken)."""
        self.running.remove(seq)
        assert seq.table is not None
        self.blocks.release(seq.table)
        seq.table = None
        slot, move = seq.slot, self.slots.release(seq.slot)
        seq.slot = -1
        if move is None:
            return slot, None
        src, dst = move
        for other in self.running:
            if other.slot == src:
                other.slot = dst
        return src, dst

    def abort(self, request_id: str) -> list[Sequence]:
        """Mark every sequence of a request aborted; the loop releases them at its next step."""
        hit = [s for s in (*self.waiting, *self.running) if s.request_id == request_id and not s.finished]
        for seq in hit:
            seq.finish(FinishReason.ABORT)
        return hit
