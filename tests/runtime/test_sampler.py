"""The numpy sampler: greedy, seeds, top-k/top-p/min-p sets, penalties, min_tokens and logprobs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from llmc.runtime.request import SamplingParams
from llmc.runtime.sampler import (
    Sampler,
    SequenceSamplingState,
    apply_penalties,
    draw,
    min_p_positions,
    sample_row,
    top_k_positions,
    top_p_positions,
)

V = 1000


def _logits(b: int, v: int = V, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, size=(b, v)).astype(np.float32)


def _states(params: list[SamplingParams], prompt: list[int] | None = None) -> list[SequenceSamplingState]:
    return [SequenceSamplingState(p, prompt or []) for p in params]


def test_greedy_is_argmax() -> None:
    logits = _logits(8)
    out = Sampler().sample(logits, _states([SamplingParams(temperature=0)] * 8))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=-1))
    assert out.token_ids.dtype == np.int64 and out.logprobs == [None] * 8


def test_greedy_mixed_batch_rows_are_argmax() -> None:
    logits = _logits(3)
    params = [SamplingParams(temperature=0), SamplingParams(seed=1), SamplingParams(temperature=0)]
    out = Sampler().sample(logits, _states(params))
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_top_k_1_equals_greedy() -> None:
    logits = _logits(16, seed=3)
    out = Sampler().sample(logits, _states([SamplingParams(temperature=1.3, top_k=1)] * 16))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=-1))


def _run(params: SamplingParams, steps: int, others: int, seed: int = 0) -> list[int]:
    """Tokens drawn for one sequence (row 0) over `steps`, alongside `others` unseeded rows."""
    sampler, state = Sampler(), SequenceSamplingState(params, [1, 2, 3])
    extra = _states([SamplingParams(temperature=0.7)] * others)
    rng = np.random.default_rng(seed)
    tokens = []
    for _ in range(steps):
        logits = np.tile(rng.normal(0, 2, size=(1, V)).astype(np.float32), (1 + others, 1))
        tokens.append(int(sampler.sample(logits, [state, *extra]).token_ids[0]))
    return tokens


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = _run(p, 20, others=0)
    assert alone == _run(p, 20, others=0)
    assert alone == _run(p, 20, others=5)
    assert alone != _run(SamplingParams(temperature=1.0, top_p=0.95, seed=4321), 20, others=0)


def test_seeded_rows_independent_within_batch() -> None:
    logits = np.zeros((3, V), dtype=np.float32)  # uniform: every draw depends only on the rng
    seeds = [SamplingParams(seed=7), SamplingParams(seed=8), SamplingParams(seed=7)]
    batch = Sampler().sample(logits, _states(seeds)).token_ids
    assert batch[0] == batch[2]
    alone = Sampler().sample(logits[:1], _states([SamplingParams(seed=8)])).token_ids[0]
    assert batch[1] == alone


def test_negative_seed_is_accepted_and_deterministic() -> None:
    logits = np.zeros((1, V), dtype=np.float32)
    draws = [Sampler().sample(logits, _states([SamplingParams(seed=-5)])).token_ids[0] for _ in range(2)]
    assert draws[0] == draws[1]


def test_top_p_hand_computed() -> None:
    vals = np.log(np.array([0.15, 0.5, 0.05, 0.3]))
    assert set(top_p_positions(vals, 0.45)) == {1}
    assert set(top_p_positions(vals, 0.6)) == {1, 3}
    assert set(top_p_positions(vals, 0.9)) == {1, 3, 0}
    assert set(top_p_positions(vals, 0.97)) == {0, 1, 2, 3}
    assert set(top_p_positions(vals, 1e-9)) == {1}  # at least one token always kept


def _hf_top_p_keep(vals: np.ndarray, p: float) -> set[int]:
    """HF TopPLogitsWarper, transcribed: ascending sort, drop where cumulative prob <= 1 - top_p."""
    order = np.argsort(vals, kind="stable")
    probs = np.exp(vals[order] - vals.max())
    cum = np.cumsum(probs / probs.sum())
    remove = cum <= 1 - p
    remove[-1] = False
    return set(order[~remove].tolist())


@settings(max_examples=200, deadline=None)
@given(
    # Logits at least 0.01 apart: no near-ties, whose order neither implementation defines.
    arrays(np.int64, st.integers(2, 600), elements=st.integers(-2000, 2000), unique=True),
    st.floats(0.01, 0.99),
)
def test_top_p_matches_hf(centi_logits: np.ndarray, p: float) -> None:
    vals = centi_logits / 100.0
    keep = set(top_p_positions(vals, p).tolist())
    ref = _hf_top_p_keep(vals, p)
    # Only the boundary token may differ, when cumulative sums round differently.
    assert len(keep ^ ref) <= 1


def test_top_p_wide_nucleus_beyond_first_window() -> None:
    vals = np.linspace(0.0, 2.0, 49152).astype(np.float32)[::-1].copy()  # nearly flat, no ties
    keep = top_p_positions(vals, 0.5)
    assert abs(len(keep) - len(_hf_top_p_keep(vals.astype(np.float64), 0.5))) <= 1
    assert len(keep) > 1000 and set(keep.tolist()) == set(range(len(keep)))


def test_top_p_keeps_ties_at_the_cut() -> None:
    assert len(top_p_positions(np.zeros(49152, dtype=np.float32), 0.5)) == 49152


def test_top_k_keeps_largest_and_ties() -> None:
    vals = np.array([1.0, 5.0, 3.0, 5.0, 4.0, 3.0])
    assert set(top_k_positions(vals, 2)) == {1, 3}
    assert set(top_k_positions(vals, 4)) == {1, 3, 4, 2, 5}  # 3.0 tied at the 4th place
    assert len(top_k_positions(vals, 0)) == 6 and len(top_k_positions(vals, -1)) == 6


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60000), st.integers(1, 300), st.integers(0, 2**32 - 1), st.booleans())
def test_top_k_matches_full_sort(n: int, k: int, seed: int, sorted_input: bool) -> None:
    vals = np.random.default_rng(seed).normal(0, 3, n).astype(np.float32)
    if sorted_input:  # the worst case for the block-maximum prefilter
        vals.sort()
    kth = np.sort(vals)[::-1][min(k, n) - 1]  # every value tied with the k-th largest is kept too (as HF does)
    expected = set(np.flatnonzero(vals >= kth).tolist()) if k < n else set(range(n))
    assert set(top_k_positions(vals, k).tolist()) == expected


def test_min_p_relative_to_max() -> None:
    vals = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert set(min_p_positions(vals, 0.2)) == {0, 1, 2}  # threshold 0.1
    assert set(min_p_positions(vals, 0.7)) == {0}


def test_sampled_frequencies_follow_filtered_distribution() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    row = np.log(probs).astype(np.float32)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, top_p=0.9)  # keeps 0, 1, 2 renormalised
    draws = np.bincount([sample_row(row, params, rng) for _ in range(20000)], minlength=4)
    np.testing.assert_allclose(draws / draws.sum(), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=0.015)


def test_low_temperature_approaches_greedy() -> None:
    row = _logits(1)[0]
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1e-6)
    assert all(sample_row(row, params, rng) == row.argmax() for _ in range(50))


@pytest.mark.parametrize("n", [5, 5000, 49152, 49153])
def test_draw_inverse_cdf(n: int) -> None:
    weights = np.zeros(n, dtype=np.float32)
    weights[[0, n // 3, n - 1]] = [1.0, 2.0, 1.0]
    assert draw(weights, 0.0) == 0
    assert draw(weights, 0.26) == n // 3 and draw(weights, 0.74) == n // 3
    assert draw(weights, 0.76) == n - 1 and draw(weights, 1.0 - 1e-12) == n - 1
    hits = np.bincount([draw(weights, u) for u in np.random.default_rng(0).random(4000)], minlength=n)
    np.testing.assert_allclose(hits[[0, n // 3, n - 1]] / 4000, [0.25, 0.5, 0.25], atol=0.03)
    assert hits.sum() == 4000


def test_repetition_penalty_hf_semantics() -> None:
    row = np.array([2.0, -2.0, 2.0, -2.0, 1.0], dtype=np.float32)
    state = SequenceSamplingState(SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 1])
    state.append(3)
    apply_penalties(row, state)
    np.testing.assert_allclose(row, [1.0, -4.0, 2.0, -4.0, 1.0])


def test_presence_frequency_penalties_generated_only() -> None:
    row = np.zeros(5, dtype=np.float32)
    state = SequenceSamplingState(
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[4]
    )
    for t in [1, 1, 1, 2]:
        state.append(t)
    apply_penalties(row, state)
    np.testing.assert_allclose(row, [0.0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0.0, 0.0])


def test_penalty_changes_greedy_choice() -> None:
    logits = np.array([[0.0, 3.0, 2.5]], dtype=np.float32)
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    out = Sampler().sample(logits, [SequenceSamplingState(params, prompt_ids=[1])])
    assert out.token_ids[0] == 2  # 3.0 / 1.5 = 2.0 < 2.5


def test_sampler_records_tokens_in_state() -> None:
    state = SequenceSamplingState(SamplingParams(temperature=0), [])
    Sampler().sample(np.array([[0.0, 1.0]], dtype=np.float32), [state])
    assert state.output_counts == {1: 1} and state.num_generated == 1


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    state = SequenceSamplingState(params, [], eos_ids=[0])
    logits = np.array([[9.0, 1.0, 2.0, 8.0]], dtype=np.float32)
    sampler = Sampler()
    assert [int(sampler.sample(logits, [state]).token_ids[0]) for _ in range(3)] == [2, 2, 0]


def test_ignore_eos_never_blocks_only_eos() -> None:
    params = SamplingParams(temperature=0, min_tokens=5, ignore_eos=True)
    state = SequenceSamplingState(params, [], eos_ids=[0])
    assert not state.blocks_now


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_raw_distribution(temperature: float) -> None:
    logits = _logits(2, v=50)
    params = SamplingParams(temperature=temperature, logprobs=3, repetition_penalty=1.3, seed=0)
    out = Sampler().sample(logits, _states([params, SamplingParams(temperature=0)], prompt=[0, 1]))
    lp = out.logprobs[0]
    assert lp is not None and out.logprobs[1] is None
    ref = logits[0].astype(np.float64) - np.log(np.exp(logits[0].astype(np.float64)).sum())
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(ref[lp.token_id], abs=1e-5)
    assert list(lp.top) == list(np.argsort(-ref)[:3])
    assert list(lp.top.values()) == pytest.approx(list(np.sort(ref)[::-1][:3]), abs=1e-5)


# -- the whole float range: a 400 (InputError) or a token, never NaN, never another exception -------------------

_ANY_FLOAT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-50, 1e-40, 1e-5, 9.99e-6, 1e-3, 0.01, 100.0, 3.5e38, 1e308]),
    st.integers(-(2**70), 2**70),
)


@settings(max_examples=400, deadline=None)
@given(temperature=_ANY_FLOAT, top_p=_ANY_FLOAT, min_p=_ANY_FLOAT, repetition_penalty=_ANY_FLOAT,
       presence_penalty=_ANY_FLOAT, frequency_penalty=_ANY_FLOAT, top_k=st.integers(-3, 2**70),
       seed=st.one_of(st.none(), st.integers(-(2**100), 2**100)), min_tokens=st.integers(0, 3),
       logprobs=st.one_of(st.none(), st.integers(0, 20)), scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
def test_every_sampling_value_is_refused_or_sampled(scale: float, **fields: object) -> None:
    from llmc.errors import InputError

    params = SamplingParams(max_tokens=4, stop_token_ids=[7], **fields)  # type: ignore[arg-type]
    try:
        params.validate(vocab_size=V)
    except InputError as e:
        assert e.param in fields, e  # the 400 names its field
        return
    logits = _logits(3, seed=1) * np.float32(scale)
    logits[1, :10] = -np.inf  # masked tokens, as a grammar or an engine may leave them
    states = [SequenceSamplingState(params, [1, 2, 3, 7], eos_ids=[5]) for _ in range(3)]
    for _ in range(3):
        out = Sampler().sample(logits, states)
        assert not out.errors, out.errors
        assert ((0 <= out.token_ids) & (out.token_ids < V)).all()
        if params.greedy and not params.has_penalties and not states[0].blocks_now:
            np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=-1))
        for lp in out.logprobs:
            assert lp is None or np.isfinite(lp.logprob) or lp.logprob == -np.inf


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (1e-50, True), (9.9e-6, True), (1e-5, False)])
def test_a_temperature_below_the_threshold_is_greedy(temperature: float, greedy: bool) -> None:
    from llmc.runtime.request import GREEDY_BELOW_TEMPERATURE

    assert GREEDY_BELOW_TEMPERATURE == 1e-5
    params = SamplingParams(temperature=temperature)
    assert params.greedy is greedy
    logits = _logits(4, seed=2)
    out = Sampler().sample(logits, _states([params] * 4))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=-1))  # 1e-5 samples, but as sharply


@pytest.mark.parametrize("value", [1e-40, 0.0099, 100.5, 1e30])
def test_repetition_penalty_outside_what_float32_carries_is_refused(value: float) -> None:
    from llmc.errors import InputError

    with pytest.raises(InputError, match=r"repetition_penalty must be in \[0.01, 100\]") as e:
        SamplingParams(repetition_penalty=value).validate()
    assert e.value.param == "repetition_penalty"


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    logits = _logits(3, seed=4)
    logits[1] = np.nan  # an engine fault in one row
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    states = _states(params)
    out = Sampler().sample(logits, states)
    assert set(out.errors) == {1} and "no finite value" in str(out.errors[1])
    assert states[1].num_generated == 0 and states[0].num_generated == states[2].num_generated == 1
    alone = [Sampler().sample(logits[i:i + 1], _states([params[i]])).token_ids[0] for i in (0, 2)]
    assert [out.token_ids[0], out.token_ids[2]] == alone


def test_a_row_with_every_token_masked_samples_its_unmasked_logits() -> None:
    logits = _logits(1, v=8, seed=5)
    params = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=list(range(8)), seed=0)
    out = Sampler().sample(logits, _states([params]))
    assert not out.errors and 0 <= out.token_ids[0] < 8
