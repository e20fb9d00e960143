"""The scheduler and slot allocator on the CPU: plans, budgets, chunking, slot moves; and a state-machine test of
the whole engine loop over a FakeEngine (no leaks, no starvation, every sequence ends exactly once)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llmc.runtime.config import RuntimeConfig
from llmc.runtime.generator import EngineLoop
from llmc.runtime.kv_allocator import SlotAllocator
from llmc.runtime.request import FinishReason, SamplingParams
from llmc.runtime.sampler import SequenceSamplingState
from llmc.runtime.scheduler import Scheduler, SchedulerConfig, StepPlan
from llmc.runtime.sequence import Sequence, Status
from llmc.runtime.stopping import StopChecker

from .fake_engine import (
    EOS,
    POISON,
    VOCAB,
    FakeEngine,
    FakeKVCache,
    FakePagedKVCache,
    check_invariants,
    greedy_reference,
)


def make_seq(name: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompt = [3] * prompt_len
    return Sequence(f"{name}/0", name, 0, prompt, params, SequenceSamplingState(params, prompt),
                    StopChecker(params, []), None)


def advance(plan: StepPlan) -> None:
    """What the engine loop does with a plan, minus the engine: prompts advance, decoders gain a token."""
    for seq, n in (*plan.prefill, *plan.extend):
        seq.prefilled += n
        if seq.prompt_done:
            seq.output_ids.append(5)
    for seq in plan.decode:
        seq.output_ids.append(5)


def tokens(plan: StepPlan) -> int:
    return sum(n for _, n in (*plan.prefill, *plan.extend)) + len(plan.decode)


# -- slot allocator ------------------------------------------------------------------------------------------

def test_allocator_keeps_slots_compact() -> None:
    slots = SlotAllocator(4, 100)
    assert [slots.allocate() for _ in "abc"] == [0, 1, 2]
    assert slots.release(0) == (2, 0)  # the last one moves into the hole
    assert slots.release(1) is None  # the last one: nothing to move
    assert slots.used == 1 and slots.free == 3
    assert slots.allocate() == 1


def test_allocator_full_and_double_release() -> None:
    slots = SlotAllocator(1, 100)
    slots.allocate()
    with pytest.raises(RuntimeError, match="no free KV slot"):
        slots.allocate()
    slots.release(0)
    with pytest.raises(AssertionError, match="slot 0 is not taken"):
        slots.release(0)


# -- scheduler -----------------------------------------------------------------------------------------------

def test_admission_stops_at_free_slots() -> None:
    sched = Scheduler(SchedulerConfig(max_running=2, max_len=100))
    seqs = [make_seq(f"r{i}", 5) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert [(s.seq_id, n) for s, n in plan.prefill] == [("r0/0", 5), ("r1/0", 5)]
    assert [s.slot for s in seqs] == [0, 1, -1] and seqs[2].status is Status.WAITING
    assert list(sched.waiting) == [seqs[2]]


def test_long_prompt_is_chunked_while_others_decode() -> None:
    sched = Scheduler(SchedulerConfig(max_running=4, max_len=200, max_step_tokens=16, min_chunk=4))
    short, long = make_seq("short", 3, max_tokens=50), make_seq("long", 40)
    sched.add(short)
    advance(sched.schedule())
    sched.add(long)
    chunks = []
    while not long.prompt_done:
        plan = sched.schedule()
        assert plan.decode[:1] == [short]  # the running request decodes in every step of the chunked prefill
        assert tokens(plan) <= 16
        chunks += [n for s, n in (*plan.prefill, *plan.extend) if s is long]
        advance(plan)
    assert chunks == [15, 15, 10]


def test_prompts_over_the_whole_limit_are_never_chunked() -> None:
    """longrope models: a prompt past `whole_prompts_over` runs in one call (beside the decoding sequences, over the
    budget if need be), never split; shorter ones are chunked as usual."""
    sched = Scheduler(SchedulerConfig(max_running=4, max_len=200, max_step_tokens=16, min_chunk=4,
                                      whole_prompts_over=20))
    short, long, chunked = make_seq("short", 3, max_tokens=50), make_seq("long", 40), make_seq("chunked", 18)
    sched.add(short)
    advance(sched.schedule())
    sched.add(chunked)
    sched.add(long)
    plan = sched.schedule()
    assert [(s.seq_id, n) for s, n in plan.prefill] == [("chunked/0", 15)] and list(sched.waiting) == [long]
    advance(plan)
    plan = sched.schedule()  # chunked's last 3 tokens: the whole prompt waits for a step without other prompts
    assert [(s.seq_id, n) for s, n in plan.extend] == [("chunked/0", 3)] and not plan.prefill
    advance(plan)
    plan = sched.schedule()
    assert [(s.seq_id, n) for s, n in plan.prefill] == [("long/0", 40)] and plan.decode == [short, chunked]


def test_small_remainder_below_min_chunk_waits() -> None:
    sched = Scheduler(SchedulerConfig(max_running=4, max_len=200, max_step_tokens=20, min_chunk=8))
    a, b = make_seq("a", 15), make_seq("b", 30)
    for s in (a, b):
        sched.add(s)
    plan = sched.schedule()
    assert [(s.seq_id, n) for s, n in plan.prefill] == [("a/0", 15)]  # 5 left: less than min_chunk 8
    assert list(sched.waiting) == [b]
    advance(plan)
    plan = sched.schedule()
    assert [(s.seq_id, n) for s, n in plan.prefill] == [("b/0", 19)] and plan.decode == [a]


def test_short_prompt_fits_below_min_chunk() -> None:
    sched = Scheduler(SchedulerConfig(max_running=4, max_len=200, max_step_tokens=20, min_chunk=8))
    a, b = make_seq("a", 15), make_seq("b", 4)
    for s in (a, b):
        sched.add(s)
    plan = sched.schedule()
    assert [(s.seq_id, n) for s, n in plan.prefill] == [("a/0", 15), ("b/0", 4)]


def test_min_chunk_above_budget_cannot_stall() -> None:
    config = SchedulerConfig(max_running=4, max_len=200, max_step_tokens=16, min_chunk=32)
    assert config.chunk_floor == 13  # a chunk beside 3 decoders always fits
    sched = Scheduler(config)
    seq = make_seq("a", 100)
    sched.add(seq)
    steps = 0
    while not seq.prompt_done:
        plan = sched.schedule()
        assert not plan.empty
        advance(plan)
        steps += 1
    assert steps == 7


def test_release_moves_last_slot_into_the_hole() -> None:
    sched = Scheduler(SchedulerConfig(max_running=3, max_len=100))
    seqs = [make_seq(f"r{i}", 2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    advance(sched.schedule())
    assert sched.release(seqs[0]) == (2, 0)
    assert (seqs[0].slot, seqs[1].slot, seqs[2].slot) == (-1, 1, 0)
    assert sched.release(seqs[1]) == (1, None) and seqs[2].slot == 0  # the last one: nothing to move
    assert sched.slots.used == 1 and sched.running == [seqs[2]]


def test_abort_marks_waiting_and_running() -> None:
    sched = Scheduler(SchedulerConfig(max_running=1, max_len=100))
    a, b = make_seq("a", 2), make_seq("a", 2)
    b.seq_id, b.index = "a/1", 1
    sched.add(a)
    sched.add(b)
    sched.schedule()
    hit = sched.abort("a")
    assert hit == [b, a] and all(s.finish_reason is FinishReason.ABORT for s in hit)
    assert sched.abort("a") == []  # already finished: not hit twice
    assert sched.release(b) is None and sched.release(a) == (0, None)  # b never held a row
    assert not sched.has_work and sched.slots.used == 0


# -- the engine loop as a state machine ------------------------------------------------------------------------

@dataclass
class Tracked:
    rid: str
    prompt: list[int]
    params: SamplingParams
    work: int  # an upper bound on its steps alone: n * (prompt + max_tokens)
    deadline: int  # the step by which it must have finished: the work of all live requests added before it, plus its own
    aborted: bool = False
    finished_at: int | None = None


prompt_tokens = st.integers(min_value=3, max_value=VOCAB - 2)
SHARED = ([], [], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42, 43, 44, 45])


class EngineLoopMachine(RuleBasedStateMachine):
    """Random adds, aborts and steps over random loop configurations (slot layout, or paged memory of few blocks:
    preemptions, shared prompt prefixes), invariants after every rule: no block leaked or owned twice, no cached
    block written, each slot caching exactly its sequence's tokens."""

    @initialize(max_running=st.integers(1, 4), extra_budget=st.integers(0, 40), min_chunk=st.integers(1, 24),
                block_size=st.sampled_from([0, 0, 2, 4, 8]), capacity=st.integers(48, 128),
                prefix_caching=st.booleans(), headroom=st.sampled_from([0, 1]))
    def setup(self, max_running: int, extra_budget: int, min_chunk: int, block_size: int, capacity: int,
              prefix_caching: bool, headroom: int) -> None:
        self.config = RuntimeConfig(max_running=max_running, kv_budget_mb=1,
                                    max_step_tokens=max_running + extra_budget, min_chunk=min_chunk,
                                    prefix_caching=prefix_caching)
        self.paged = block_size > 0
        self.token_bytes = 2**20 // capacity if self.paged else 0  # about `capacity` tokens of KV memory
        self.engine = FakeEngine(block_size=block_size, token_bytes=self.token_bytes)
        self.loop = EngineLoop(self.engine, None, self.config)
        if isinstance(self.loop.kv, FakePagedKVCache):
            self.loop.kv.frozen = self.loop.scheduler.blocks.is_cached
        # no headroom: admission fills the memory and decodes preempt often
        self.loop.scheduler.config = replace(self.loop.scheduler.config, decode_headroom=headroom)
        self.requests: dict[str, Tracked] = {}
        self.streamed: dict[str, list[int]] = {}  # seq_id -> tokens from updates
        self.finals: dict[str, int] = {}  # seq_id -> final updates seen
        self.steps = 0
        self.queued_work = 0

    # -- rules ----------------------------------------------------------------------------------------------
    @rule(prompt=st.lists(prompt_tokens, min_size=1, max_size=50), max_tokens=st.integers(1, 24),
          n=st.sampled_from([1, 1, 1, 2, 3]), kind=st.sampled_from(["greedy", "greedy", "no_eos", "seeded", "poison"]),
          seed=st.integers(0, 2**32), fail_after=st.integers(0, 60), shared=st.sampled_from(SHARED))
    def add(self, prompt: list[int], max_tokens: int, n: int, kind: str, seed: int, fail_after: int,
            shared: list[int]) -> None:
        prompt = shared + prompt
        if kind == "poison":
            prompt = [POISON, fail_after, *prompt]
        if len(prompt) + max_tokens > self.loop.max_len:
            return  # refused (LimitError), tested elsewhere
        sampled = kind == "seeded"
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.7 if sampled else 0.0,
                                seed=seed if sampled else None, ignore_eos=kind == "no_eos")
        rid = self.loop.add_request(prompt, params)
        work = n * (len(prompt) + max_tokens)
        self.queued_work += work
        before = sum(r.work for r in self.requests.values() if r.finished_at is None and not r.aborted)
        self.requests[rid] = Tracked(rid, prompt, params, work, self.steps + before + work)

    @precondition(lambda self: any(not r.aborted and r.finished_at is None for r in self.requests.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted(r.rid for r in self.requests.values() if not r.aborted and r.finished_at is None)
        rid = data.draw(st.sampled_from(live))
        self.loop.abort(rid)
        self.requests[rid].aborted = True
        for seq in self.loop.requests[rid]:
            assert seq.finished and seq.slot == -1

    @rule()
    def step(self) -> None:
        busy, calls = self.loop.has_work, len(self.engine.calls)
        updates = self.loop.step()
        self.steps += 1
        step_tokens = sum(c.num_tokens for c in self.engine.calls[calls:] if not c.failed)
        assert step_tokens <= self.config.max_step_tokens
        assert len(self.engine.calls) > calls or not busy, "a step with work made no progress"
        for u in updates:
            seq_id = f"{u.request_id}/{u.index}"
            assert seq_id not in self.finals, f"{seq_id} updated after its final update"
            assert len(u.token_ids) <= 1 and (u.token_ids or u.finish_reason is not None)
            self.streamed.setdefault(seq_id, []).extend(u.token_ids)
            if u.finish_reason is not None:
                self.finals[seq_id] = self.finals.get(seq_id, 0) + 1
        for rid, seqs in self.loop.requests.items():
            tracked = self.requests[rid]
            if tracked.finished_at is None and all(s.finished for s in seqs):
                tracked.finished_at = self.steps

    @invariant()
    def slots_and_cache_match_sequences(self) -> None:
        check_invariants(self.loop)

    # -- at the end -----------------------------------------------------------------------------------------
    def teardown(self) -> None:
        if not hasattr(self, "loop"):
            return
        # preempted sequences compute their tokens again: a looser bound, still finite
        limit = self.steps + (4 * self.queued_work + 10 if self.paged else self.queued_work + 1)
        while self.loop.has_work:
            assert self.steps <= limit, "requests still running after all their work"
            self.step()
            check_invariants(self.loop)
        assert self.loop.scheduler.slots.used == 0 and not self.loop.scheduler.running
        kv, blocks = self.loop.kv, self.loop.scheduler.blocks
        assert isinstance(kv, (FakeKVCache, FakePagedKVCache))
        assert not kv.lengths.any() and not any(kv.history(s) for s in range(kv.num_slots))
        assert blocks.num_free == blocks.num_blocks and not any(blocks.refs)
        for tracked in self.requests.values():
            self.check_request(tracked)

    def check_request(self, tracked: Tracked) -> None:
        seqs = self.loop.requests[tracked.rid]
        assert len(seqs) == tracked.params.n and all(s.finished for s in seqs)
        for seq in seqs:
            aborted = seq.finish_reason is FinishReason.ABORT
            assert self.finals.get(seq.seq_id, 0) == (0 if aborted else 1), f"{seq.seq_id} ended wrongly"
            assert self.streamed.get(seq.seq_id, []) == seq.output_ids
            assert len(seq.output_ids) <= tracked.params.max_tokens
            assert aborted <= tracked.aborted
            assert (seq.finish_reason is FinishReason.ERROR) <= (tracked.prompt[0] == POISON)
        if tracked.aborted or tracked.prompt[0] == POISON:
            return
        assert tracked.finished_at is not None
        assert self.paged or tracked.finished_at <= tracked.deadline, "request starved"
        self.check_alone(tracked, seqs)

    def check_alone(self, tracked: Tracked, seqs: list[Sequence]) -> None:
        """Each sequence generated exactly what it generates alone."""
        p = tracked.params
        if p.greedy:
            want = greedy_reference(tracked.prompt, p.max_tokens, (EOS,), p.ignore_eos)
            assert all(s.output_ids == want for s in seqs)
            return
        alone = EngineLoop(FakeEngine(block_size=self.engine.block_size, token_bytes=self.token_bytes), None,
                           self.config)
        rid = alone.add_request(tracked.prompt, p)
        while alone.has_work:
            alone.step()
        assert [c.token_ids for c in alone.pop(rid).outputs] == [s.output_ids for s in seqs]


TestEngineLoopMachine = EngineLoopMachine.TestCase
TestEngineLoopMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])


# -- paged memory: preemption and prefix caching over the FakeEngine -------------------------------------------

def paged_loop(capacity: int, block_size: int = 4, max_running: int = 4, headroom: int = 1,
               prefix_caching: bool = True) -> EngineLoop:
    engine = FakeEngine(block_size=block_size, token_bytes=2**20 // capacity)
    loop = EngineLoop(engine, None, RuntimeConfig(max_running=max_running, kv_budget_mb=1, max_step_tokens=64,
                                                  prefix_caching=prefix_caching))
    assert isinstance(loop.kv, FakePagedKVCache)
    loop.kv.frozen = loop.scheduler.blocks.is_cached
    loop.scheduler.config = replace(loop.scheduler.config, decode_headroom=headroom)
    return loop


def run_all(loop: EngineLoop) -> None:
    while loop.has_work:
        loop.step()
        check_invariants(loop)


def test_preempted_sequence_resumes_to_the_uninterrupted_output() -> None:
    loop = paged_loop(capacity=32, headroom=0, max_running=2)  # 8 blocks of 4
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    a, b = [3 + i for i in range(12)], [20 + i for i in range(12)]
    ra, rb = loop.add_request(a, params), loop.add_request(b, params)
    run_all(loop)
    assert loop.stats().preemptions >= 1
    assert loop.result(ra).outputs[0].token_ids == greedy_reference(a, 14, ignore_eos=True)
    assert loop.result(rb).outputs[0].token_ids == greedy_reference(b, 14, ignore_eos=True)


def test_shared_prefix_is_computed_once_and_outputs_are_unchanged() -> None:
    loop = paged_loop(capacity=256)
    system = [5 + i % 50 for i in range(40)]  # 10 full blocks
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    first = loop.add_request(system + [9, 9, 9], params)
    run_all(loop)
    loop.engine.calls.clear()  # type: ignore[attr-defined]
    rids = [loop.add_request(system + [10 + i, 11], params) for i in range(3)]
    run_all(loop)
    prompt_calls = [c for c in loop.engine.calls if any(len(t) > 1 for t in c.tokens)]  # type: ignore[attr-defined]
    assert all(c.kind == "decode" for c in prompt_calls)  # after the cached prefix: no prefill from 0
    assert sum(len(t) for c in prompt_calls for t in c.tokens) == 3 * 2  # only the questions were computed
    for rid, i in zip(rids, range(3)):
        out = loop.result(rid).outputs[0].token_ids
        assert out == greedy_reference(system + [10 + i, 11], 5, ignore_eos=True)
        assert loop.requests[rid][0].cached_tokens == 40
    assert loop.requests[first][0].cached_tokens == 0
    stats = loop.stats()
    assert stats.prefix_hit_tokens == 120 and stats.prefix_queried_tokens == 43 + 3 * 42
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached > 10


def test_multi_turn_computes_only_the_new_tokens() -> None:
    loop = paged_loop(capacity=256)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    history = [7 + i % 40 for i in range(21)]
    previous = 0  # tokens of the previous turn's prompt and answer
    for turn in range(3):
        rid = loop.add_request(history, params)
        hit_before = loop.stats().prefix_hit_tokens
        run_all(loop)
        cached = loop.stats().prefix_hit_tokens - hit_before
        out = loop.result(rid).outputs[0].token_ids
        # the previous turn's prompt and answer (all but its last token, never fed) are cached, to a block edge
        assert cached == (max(previous - 1, 0) // 4 * 4 if turn else 0)
        previous = len(history) + len(out)
        history = history + out + [8, 9, 10]


def test_prefix_caching_off_and_slot_engines_share_nothing() -> None:
    loop = paged_loop(capacity=256, prefix_caching=False)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for _ in range(2):
        loop.add_request(list(range(3, 30)), params)
        run_all(loop)
    assert loop.stats().prefix_hit_tokens == 0
    slots = EngineLoop(FakeEngine(), None, RuntimeConfig(max_running=2, kv_budget_mb=1))
    assert not slots.scheduler.blocks.prefix_caching and not slots.scheduler.config.paged
