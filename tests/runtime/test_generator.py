"""The engine loop: continuous batching gives each request exactly what it gets alone; per-request sampling,
n completions, chunked prefill beside decoding, aborts and engine errors that stay in their request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from llmc.errors import InputError, LimitError
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.generator import EngineLoop, SeqUpdate
from llmc.runtime.request import FinishReason, RequestOutput, SamplingParams

from .fake_engine import POISON, FakeEngine, FakeKVCache, check_invariants, greedy_reference

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int = 0, low: int = 3, high: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, n).tolist() for n in lengths]


def run(loop: EngineLoop, requests: list[tuple[list[int], SamplingParams]],
        on_step: Callable[[list[SeqUpdate]], None] | None = None) -> list[RequestOutput]:
    """Add all requests, step until done (checking the invariants), return their outputs in order."""
    rids = [loop.add_request(p, params) for p, params in requests]
    for _ in range(10_000):
        if not loop.has_work:
            break
        updates = loop.step()
        if isinstance(loop.kv, FakeKVCache):
            check_invariants(loop)
        if on_step is not None:
            on_step(updates)
    assert not loop.has_work and loop.scheduler.slots.used == 0 and not loop.kv.lengths.any()
    return [loop.pop(r) for r in rids]


def fake_loop(**config: Any) -> EngineLoop:
    return EngineLoop(FakeEngine(), None, RuntimeConfig(**{"kv_budget_mb": 1, **config}))


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# -- continuous batching is exact --------------------------------------------------------------------------

@pytest.mark.parametrize(("max_running", "max_step_tokens", "min_chunk"), [(3, 2048, 32), (3, 16, 4), (1, 8, 8)])
def test_concurrent_greedy_equals_alone(max_running: int, max_step_tokens: int, min_chunk: int) -> None:
    prompts = prompts_of([1, 7, 30, 3, 55, 12])
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (9, 2, 14, 5, 7, 11)]
    loop = fake_loop(max_running=max_running, max_step_tokens=max_step_tokens, min_chunk=min_chunk)
    together = run(loop, list(zip(prompts, params)))
    for out, prompt, p in zip(together, prompts, params):
        assert out.outputs[0].token_ids == greedy_reference(prompt, p.max_tokens)
        assert out.outputs[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    alone = [run(fake_loop(max_running=1), [(pr, p)])[0] for pr, p in zip(prompts, params)]
    assert tokens(together) == tokens(alone)


def test_mixed_sampling_params_in_one_batch() -> None:
    prompts = prompts_of([6, 20, 4, 9])
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.3, min_p=0.05, seed=123, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)]
    together = run(fake_loop(max_running=4, max_step_tokens=16, min_chunk=4), list(zip(prompts, params)))
    alone = [run(fake_loop(max_running=1), [(pr, p)])[0] for pr, p in zip(prompts, params)]
    assert tokens(together) == tokens(alone)
    assert tokens(together)[0] == greedy_reference(prompts[0], 12, ignore_eos=True)
    assert tokens(together)[1] != greedy_reference(prompts[1], 12, ignore_eos=True)  # it did sample


def test_per_request_stop_conditions() -> None:
    prompt = prompts_of([5])[0]
    ref = greedy_reference(prompt, 10, ignore_eos=True)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[ref[3]]),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    outs = run(fake_loop(max_running=3), [(prompt, p) for p in params])
    first_stop = ref.index(ref[3]) + 1
    assert [o.outputs[0].token_ids for o in outs] == [ref[:first_stop], ref[:4], ref]
    assert [o.outputs[0].finish_reason for o in outs] == [FinishReason.STOP, FinishReason.LENGTH, FinishReason.LENGTH]


def test_n_completions_each_own_slot_and_seed() -> None:
    prompt = prompts_of([10])[0]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3, ignore_eos=True)
    loop = fake_loop(max_running=4)
    rid = loop.add_request(prompt, seeded)
    loop.step()
    assert sorted(s.slot for s in loop.requests[rid]) == [0, 1, 2]
    while loop.has_work:
        loop.step()
        check_invariants(loop)
    outs = loop.pop(rid).outputs
    assert [o.index for o in outs] == [0, 1, 2] and len({tuple(o.token_ids) for o in outs}) == 3
    for i, out in enumerate(outs):
        single = SamplingParams(max_tokens=10, temperature=1.0, seed=5 + i, ignore_eos=True)
        assert out.token_ids == run(fake_loop(max_running=1), [(prompt, single)])[0].outputs[0].token_ids
    greedy = run(fake_loop(max_running=2), [(prompt, SamplingParams(max_tokens=6, temperature=0.0, n=3))])[0]
    assert all(o.token_ids == greedy_reference(prompt, 6) for o in greedy.outputs)


# -- scheduling behaviour seen from the loop ---------------------------------------------------------------

def test_chunked_prefill_while_others_decode() -> None:
    loop = fake_loop(max_running=4, max_step_tokens=16, min_chunk=4)
    short = loop.add_request(prompts_of([3])[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    loop.step()
    long_prompt = prompts_of([60], seed=1)[0]
    long = loop.add_request(long_prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine = loop.engine
    assert isinstance(engine, FakeEngine)
    steps, first_call = 0, len(engine.calls)
    while not loop.requests[long][0].output_ids:
        calls = len(engine.calls)
        updates = loop.step()
        check_invariants(loop)
        steps += 1
        assert short in {u.request_id for u in updates if u.token_ids}  # the short one decodes every step
        assert sum(c.num_tokens for c in engine.calls[calls:]) <= 16
    assert steps == 4  # 60 prompt tokens at 15 per step beside one decoder
    chunks = [len(row) for c in engine.calls[first_call:] for row in c.tokens if len(row) > 1]
    assert chunks == [15, 15, 15, 15]
    while loop.has_work:
        loop.step()
    assert loop.pop(long).outputs[0].token_ids == greedy_reference(long_prompt, 3, ignore_eos=True)


def test_long_prompt_with_budget_below_min_chunk_finishes() -> None:
    """min_chunk (32) above max_step_tokens (16) used to leave the prompt waiting for ever."""
    loop = fake_loop(max_running=2, max_step_tokens=16)
    prompt = prompts_of([100])[0]
    out = run(loop, [(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))])[0]
    assert out.outputs[0].token_ids == greedy_reference(prompt, 4, ignore_eos=True)


def test_requests_join_as_others_leave() -> None:
    loop = fake_loop(max_running=2)
    prompts = prompts_of([4, 4, 4, 4])
    lengths = [2, 6, 3, 2]
    rids = [loop.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
            for p, m in zip(prompts, lengths)]
    running_per_step = []
    while loop.has_work:
        loop.step()
        running_per_step.append(sorted(s.request_id for s in loop.scheduler.running))
    # r0 leaves after step 2 and r2 joins at step 3 while r1 keeps decoding
    assert running_per_step[:4] == [[rids[0], rids[1]], [rids[1]], [rids[1], rids[2]], [rids[1], rids[2]]]
    assert [loop.pop(r).outputs[0].token_ids for r in rids] == [
        greedy_reference(p, m, ignore_eos=True) for p, m in zip(prompts, lengths)]


def test_abort_frees_slot_for_the_next_request() -> None:
    loop = fake_loop(max_running=2)
    a, b, c = (loop.add_request(p, GREEDY) for p in prompts_of([5, 6, 7]))
    loop.step()
    loop.step()
    assert loop.requests[a][0].slot == 0 and loop.scheduler.slots.used == 2
    loop.abort(a)
    check_invariants(loop)  # b moved into slot 0, its cache with it
    assert loop.requests[b][0].slot == 0 and loop.scheduler.slots.used == 1
    assert loop.result(a).outputs[0].finish_reason is FinishReason.ABORT
    updates = loop.step()
    assert c in {s.request_id for s in loop.scheduler.running}
    assert all(u.request_id != a for u in updates)
    loop.abort(c)  # abort while waiting or running: both free
    while loop.has_work:
        loop.step()
    assert loop.scheduler.slots.used == 0 and not loop.kv.lengths.any()
    assert loop.pop(b).outputs[0].finish_reason is FinishReason.LENGTH


def test_abort_waiting_request_never_runs() -> None:
    loop = fake_loop(max_running=1)
    a, b = (loop.add_request(p, GREEDY) for p in prompts_of([5, 6]))
    loop.abort(b)
    outs = run(loop, [])
    assert outs == [] and loop.result(b).outputs[0].token_ids == [] and loop.result(a).finished
    engine = loop.engine
    assert isinstance(engine, FakeEngine)
    assert [c.kind for c in engine.calls].count("prefill") == 1  # only a ever ran


@pytest.mark.parametrize("fail_after", [0, 5, 12, 14])
def test_engine_error_fails_only_its_request(fail_after: int) -> None:
    """The poisoned request fails in a batched prefill (0), in a prompt chunk (5), in a batched decode (12) or
    not at all (14)."""
    good = prompts_of([4, 9, 2])
    bad = [POISON, fail_after, *prompts_of([8], seed=3)[0]]
    loop = fake_loop(max_running=4, max_step_tokens=8, min_chunk=2)
    finals: dict[str, FinishReason] = {}

    def record(updates: list[SeqUpdate]) -> None:
        for u in updates:
            if u.finish_reason is not None:
                assert u.request_id not in finals
                finals[u.request_id] = u.finish_reason

    outs = run(loop, [(good[0], GREEDY), (bad, GREEDY), (good[1], GREEDY), (good[2], GREEDY)], record)
    expected = FinishReason.ERROR if fail_after < len(bad) + 8 - 1 else FinishReason.LENGTH
    assert outs[1].outputs[0].finish_reason is expected and finals[outs[1].request_id] is expected
    assert len(outs[1].outputs[0].token_ids) == min(8, max(0, fail_after - len(bad) + 1))
    for out, prompt in zip([outs[0], *outs[2:]], good):
        assert out.outputs[0].token_ids == greedy_reference(prompt, 8, ignore_eos=True)
        assert finals[out.request_id] is FinishReason.LENGTH


# -- request checks ------------------------------------------------------------------------------------------

def test_request_checks() -> None:
    loop = fake_loop(max_running=2)
    with pytest.raises(LimitError, match="prompt has 600 tokens, the context holds 512"):
        loop.add_request([3] * 600, GREEDY)
    with pytest.raises(LimitError, match=r"\+ max_tokens \(8\) = 513 exceeds the context of 512"):
        loop.add_request([3] * 505, GREEDY)
    with pytest.raises(InputError, match="prompt is empty"):
        loop.add_request([], GREEDY)
    with pytest.raises(InputError, match=r"token id 64 is outside the vocabulary \[0, 64\)"):
        loop.add_request([64], GREEDY)
    loop.add_request([3], GREEDY, request_id="x")
    with pytest.raises(InputError, match="request id 'x' is already in use"):
        loop.add_request([3], GREEDY, request_id="x")
    loop.add_request([3], GREEDY, request_id="req-0")
    assert loop.add_request([3], GREEDY) == "req-1"  # generated ids skip ids a caller chose
    assert not loop.scheduler.running and len(loop.scheduler.waiting) == 3


def test_loop_rejects_budget_below_batch() -> None:
    with pytest.raises(InputError, match=r"--max-step-tokens \(4\) must be >= --max-running \(8\)"):
        fake_loop(max_running=8, max_step_tokens=4)


# -- a real engine ---------------------------------------------------------------------------------------------

def test_ort_concurrent_greedy_equals_alone(tiny_llama: Any) -> None:
    """Six prompts of different lengths on a real tiny ONNX engine: 4 slots, so requests join as others leave;
    then again with a small step budget, so long prompts are chunked beside decoding ones."""
    from llmc.runtime.llm import LLM, LLMConfig

    llm = LLM(tiny_llama.engine_dir, LLMConfig(max_running=4))
    prompts = prompts_of([5, 23, 2, 41, 11, 17], seed=1, low=3, high=llm.engine.vocab_size)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (12, 4, 20, 7, 15, 9)]
    params[3] = SamplingParams(max_tokens=7, temperature=0.8, top_k=40, seed=11, ignore_eos=True)
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    together = llm.generate(prompts, params)
    assert tokens(together) == tokens(alone)
    chunked = EngineLoop(llm.engine, llm.tokenizer, RuntimeConfig(max_running=4, max_step_tokens=8, min_chunk=4))
    assert tokens(run(chunked, list(zip(prompts, params)))) == tokens(alone)
    assert [len(t) for t in tokens(alone)] == [p.max_tokens for p in params]


# -- one sequence's sampling or detokenizing fault ends only that sequence ----------------------------------------

NAN_MARK = 61  # a prompt starting with this gets NaN logits from the engine below


class _NaNEngine(FakeEngine):
    def logits(self, history: list[int]) -> np.ndarray:
        row = super().logits(history)
        if history[0] == NAN_MARK:
            row[:] = np.nan
        return row


class _BadDetok:
    def step(self, token_id: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")


@pytest.mark.parametrize("fault", ["sampling", "detokenizing"])
def test_a_row_that_fails_after_the_engine_ends_only_its_request(fault: str) -> None:
    good = prompts_of([4, 9, 2])
    sampled = SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True)
    loop = EngineLoop(_NaNEngine(), None, RuntimeConfig(max_running=4, kv_budget_mb=1))
    bad = [NAN_MARK, 5, 6] if fault == "sampling" else [8, 9]
    rids = [loop.add_request(p, sampled) for p in (good[0], bad, good[1], good[2])]
    if fault == "detokenizing":
        loop.requests[rids[1]][0].detok = _BadDetok()  # type: ignore[assignment]
    finals: dict[str, list[FinishReason]] = {}
    while loop.has_work:
        for u in loop.step():
            if u.finish_reason is not None:
                finals.setdefault(u.request_id, []).append(u.finish_reason)
        check_invariants(loop)
    outs = [loop.pop(r) for r in rids]
    assert outs[1].outputs[0].finish_reason is FinishReason.ERROR and finals[rids[1]] == [FinishReason.ERROR]
    alone = [run(fake_loop(max_running=1), [(p, sampled)])[0] for p in good]
    for out, ref, rid in zip([outs[0], *outs[2:]], alone, [rids[0], *rids[2:]]):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and len(ref.outputs[0].token_ids) == 8
        assert finals[rid] == [FinishReason.LENGTH]
