"""Choosing the next token for each sequence of a decode batch (numpy only).

Per row, in this order (the order of HF transformers' processors and warpers):
repetition_penalty (HF: over prompt + generated tokens, positive logits divided, negative multiplied),
frequency/presence penalties (OpenAI: over generated tokens only), logit_bias, the constraint's mask (a row with a
JSON schema, regex or grammar: every token it does not allow at -inf), then greedy argmax when temperature == 0,
else temperature, top-k, top-p, min-p, and a draw from the row's own `numpy.random.Generator`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from llmc.errors import EngineError
from llmc.runtime.request import SamplingParams, TokenLogprob
from llmc.runtime.structured import GrammarState, apply_mask

# top-p first looks for its cut-off among this many most likely tokens, so that the usual peaked
# distribution never pays for a full-vocabulary sort.
_TOP_P_WINDOW = 256
# Draws over more candidates than this find their block first, sparing a full-vocabulary cumsum.
_DRAW_BLOCK = 1024
# A wide top-p nucleus is found by bucketing logits into this many buckets over [-range, 0].
_NUCLEUS_BUCKETS = 256
_NUCLEUS_RANGE = 32.0
# Smallest block for the block-maximum prefilter; below it the reshape costs more than it saves.
_MIN_BLOCK = 16
# Temperatures above this act as this (all candidates nearly equally likely); a float32 inf would make -inf / inf NaN.
_MAX_TEMPERATURE = 1e30
_F32_MAX = float(np.finfo(np.float32).max)


class SequenceSamplingState:
    """One sequence's sampler state: its params, a private RNG, its generated tokens (`generated`: the one list of
    them, which `Sequence.output_ids` is) and the token counts penalties need.

    The RNG is seeded from `params.seed`, so a seeded sequence draws the same tokens whatever else is
    in the batch; without a seed it is seeded from OS entropy.
    """

    def __init__(
        self, params: SamplingParams, prompt_ids: Sequence[int], eos_ids: Iterable[int] = (),
        grammar: GrammarState | None = None,
    ) -> None:
        self.params = params
        self.grammar = grammar  # the request's constraint, when it has one
        # numpy wants a non-negative seed; OpenAI clients may send any 64-bit integer.
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.generated: list[int] = []
        self.output_counts: dict[int, int] = {}
        self._seen: set[int] = {int(t) for t in prompt_ids}  # prompt + generated, for repetition_penalty
        self._seen_arr: np.ndarray | None = None
        self._seen_max = -1
        # As HF's MinNewTokensLengthLogitsProcessor: these cannot be drawn before min_tokens tokens.
        blocked = set() if params.ignore_eos else {int(t) for t in eos_ids}
        self.blocked_ids = np.array(sorted(blocked | set(params.stop_token_ids)), dtype=np.int64)
        self.bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
        self.bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias))

    @property
    def num_generated(self) -> int:
        return len(self.generated)

    @property
    def plain(self) -> bool:
        """Nothing changes this row's logits (no penalty, bias, min_tokens mask or constraint)."""
        return not (self.params.has_penalties or self.bias_ids.size or self.grammar is not None or self.blocks_now)

    @property
    def blocks_now(self) -> bool:
        """Whether EOS / stop token ids must be masked for the next token (min_tokens not reached)."""
        return len(self.generated) < self.params.min_tokens and self.blocked_ids.size > 0

    def append(self, token_id: int) -> None:
        """Record a generated token (the sampler does this itself for the tokens it chooses)."""
        token_id = int(token_id)
        self.generated.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        if token_id not in self._seen:
            self._seen.add(token_id)
            self._seen_arr = None

    def seen_ids(self, width: int | None = None) -> np.ndarray:
        """Distinct ids of prompt and generated tokens, `[n]` int64 (cached until a new id appears); with `width`,
        those below it (a prompt may hold ids a pruned head cannot produce: it has no logit for them)."""
        if self._seen_arr is None:
            self._seen_arr = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
            self._seen_max = int(self._seen_arr.max()) if self._seen_arr.size else -1
        arr = self._seen_arr
        return arr if width is None or self._seen_max < width else arr[arr < width]

    def output_count_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Generated token ids and how often each occurred, both `[n]`."""
        ids = np.fromiter(self.output_counts.keys(), dtype=np.int64, count=len(self.output_counts))
        counts = np.fromiter(self.output_counts.values(), dtype=np.float32, count=len(self.output_counts))
        return ids, counts


@dataclass
class SamplerOutput:
    """The chosen tokens `[B]` and, per row that asked for them (`params.logprobs` set), their logprobs.

    `errors` holds the rows that could not be sampled (row -> exception): their token is meaningless and their
    state is unchanged; every other row is sampled as it would be alone.
    """

    token_ids: np.ndarray
    logprobs: list[TokenLogprob | None]
    errors: dict[int, Exception] = field(default_factory=dict)


def apply_penalties(row: np.ndarray, state: SequenceSamplingState) -> None:
    """Apply the min_tokens mask, the repetition, frequency and presence penalties and logit_bias to `[V]`, in
    place."""
    p = state.params
    if state.blocks_now:
        row[state.blocked_ids[state.blocked_ids < row.shape[0]]] = -np.inf
    if p.repetition_penalty != 1.0:
        ids = state.seen_ids(row.shape[0])
        vals = row[ids]
        row[ids] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and state.output_counts:
        ids, counts = state.output_count_arrays()
        row[ids] -= counts * p.frequency_penalty + p.presence_penalty
    if state.bias_ids.size:
        keep = state.bias_ids < row.shape[0]
        row[state.bias_ids[keep]] += state.bias_values[keep]


def _top_superset(vals: np.ndarray, k: int) -> np.ndarray:
    """Positions of a small superset of the `k` largest values, without partitioning all of `vals`.

    The k-th largest block maximum is at most the k-th largest value, so every top-k value passes it;
    block maxima are cheap (a reshape), unlike an argpartition of the vocabulary.
    """
    n = vals.shape[0]
    block = n // (4 * k)
    if block < _MIN_BLOCK:
        return np.arange(n)
    maxes = vals[: n - n % block].reshape(-1, block).max(axis=1)
    return np.flatnonzero(vals >= np.partition(maxes, maxes.shape[0] - k)[maxes.shape[0] - k])


def top_k_positions(vals: np.ndarray, k: int) -> np.ndarray:
    """Positions of the `k` largest values, plus any tied with the k-th (HF keeps ties); no full sort."""
    if k <= 0 or k >= vals.shape[0]:
        return np.arange(vals.shape[0])
    sup = _top_superset(vals, k)
    sub = vals[sup]
    kth = np.partition(sub, sub.shape[0] - k)[sub.shape[0] - k]
    return sup[sub >= kth]


def _top_sorted(vals: np.ndarray, n: int) -> np.ndarray:
    """Positions of the `n` largest values, largest first."""
    sup = _top_superset(vals, n)
    sup = sup[np.argpartition(vals[sup], sup.shape[0] - n)[sup.shape[0] - n :]]
    return sup[np.argsort(vals[sup], kind="stable")[::-1]]


def top_p_positions(vals: np.ndarray, p: float) -> np.ndarray:
    """Positions of the smallest most-likely set whose probability reaches `p` (at least one kept).

    `vals` are logits; probabilities are their softmax. As HF TopPLogitsWarper: a token is kept when
    the tokens ranked above it hold less than `p`. Tokens tied with the last one kept are kept too.
    """
    n = vals.shape[0]
    if p >= 1.0 or n == 1:
        return np.arange(n)
    probs = np.exp(vals - vals.max())
    probs /= probs.sum(dtype=np.float64)
    if n > _TOP_P_WINDOW:
        order = _top_sorted(probs, _TOP_P_WINDOW)
        cum = np.cumsum(probs[order], dtype=np.float64)
        if cum[-1] >= p:
            return order[: int(np.searchsorted(cum, p)) + 1]
    return np.flatnonzero(probs >= _nucleus_floor(vals - vals.max(), probs, p))


def _nucleus_floor(shifted: np.ndarray, probs: np.ndarray, p: float) -> float:
    """The smallest probability in a wide top-p nucleus, without sorting the vocabulary.

    Tokens are bucketed by logit (`shifted` <= 0); the bucket where the mass counted from the top
    reaches `p` is the only one sorted. Logits below -_NUCLEUS_RANGE share the last bucket.
    """
    bucket = np.minimum(
        (shifted * np.float32(-_NUCLEUS_BUCKETS / _NUCLEUS_RANGE)).astype(np.intp), _NUCLEUS_BUCKETS - 1
    )
    cum = np.cumsum(np.bincount(bucket, weights=probs, minlength=_NUCLEUS_BUCKETS))
    b = min(int(np.searchsorted(cum, p)), _NUCLEUS_BUCKETS - 1)
    members = np.sort(probs[bucket == b])[::-1]
    while members.shape[0] == 0:  # rounding chose an empty bucket: its upper neighbour holds the cut
        b -= 1
        members = np.sort(probs[bucket == b])[::-1]
    local = np.cumsum(members, dtype=np.float64) + (float(cum[b - 1]) if b else 0.0)
    return float(members[min(int(np.searchsorted(local, p)), members.shape[0] - 1)])


def min_p_positions(vals: np.ndarray, min_p: float) -> np.ndarray:
    """Positions whose probability is at least `min_p` times the largest probability."""
    if min_p <= 0.0:
        return np.arange(vals.shape[0])
    # prob_i / prob_max == exp(logit_i - logit_max), so no softmax is needed.
    return np.flatnonzero(vals >= vals.max() + np.log(min_p))


def draw(weights: np.ndarray, u: float) -> int:
    """Index i with probability weights[i] / sum(weights), by the inverse CDF at `u` in [0, 1)."""
    n, start = weights.shape[0], 0
    target = u * float(weights.sum(dtype=np.float64))
    if n > 4 * _DRAW_BLOCK:
        last = (n // _DRAW_BLOCK - 1) * _DRAW_BLOCK  # the last block also takes the remainder
        sums = np.append(
            weights[:last].reshape(-1, _DRAW_BLOCK).sum(axis=1, dtype=np.float64),
            weights[last:].sum(dtype=np.float64),
        )
        cum = np.cumsum(sums)
        b = int(np.searchsorted(cum, target, side="right"))
        if b >= sums.shape[0]:  # rounding put target past the end: take the last block with weight
            b = int(np.flatnonzero(sums > 0)[-1])
        target -= float(cum[b - 1]) if b else 0.0
        start = b * _DRAW_BLOCK
        weights = weights[start : start + _DRAW_BLOCK] if start < last else weights[start:]
    # side="right" never lands on a zero weight (its cumulative sum equals its neighbour's).
    i = min(
        int(np.searchsorted(np.cumsum(weights, dtype=np.float64), target, side="right")), weights.shape[0] - 1
    )
    while weights[i] == 0 and i > 0:  # rounding put target past the last positive weight
        i -= 1
    return start + i


def finite_row(row: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """`row` with NaN as -inf and +inf as the largest float32, so that `row - row.max()` has no NaN.

    A row with no finite value left (every token masked or penalised away) gives way to `fallback`, the row's
    logits before masking and penalties; if those have none either, the engine produced no usable logits.
    """
    if np.isfinite(row.max()):
        return row
    row = np.nan_to_num(row, nan=-np.inf, posinf=_F32_MAX)
    if np.isfinite(row.max()):
        return row
    if fallback is not row and np.isfinite(np.nan_to_num(fallback, nan=-np.inf, posinf=_F32_MAX).max()):
        return finite_row(fallback, fallback)
    raise EngineError("the engine's logits for this row hold no finite value")


def finite_allowed(row: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """A masked row with a finite maximum, NaN and -inf left out (unlike `finite_row`, a masked token never
    becomes finite): `row`, else the masked logits before penalties; else no allowed token can be chosen."""
    for r in (row, fallback):
        r = np.nan_to_num(r, nan=-np.inf, posinf=_F32_MAX, neginf=-np.inf)
        if np.isfinite(r.max()):
            return r
    raise EngineError("the constraint allows no token with a finite logit")


def sample_row(row: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Draw one token id from a penalised float32 row of logits `[V]` with a temperature that is not greedy."""
    temperature = np.float32(min(params.temperature, _MAX_TEMPERATURE))
    x = (row - row.max()) / temperature  # shift first: tiny temperatures overflow
    ids: np.ndarray | None = None  # candidate token ids; None while all of them are candidates
    if 0 < params.top_k < x.shape[0]:
        ids = top_k_positions(x, params.top_k)
        x = x[ids]
    for keep_fn, arg, active in (
        (top_p_positions, params.top_p, params.top_p < 1.0),
        (min_p_positions, params.min_p, params.min_p > 0.0),
    ):
        if active:
            keep = keep_fn(x, arg)
            ids, x = (keep if ids is None else ids[keep]), x[keep]
    i = draw(np.exp(x - x.max()), rng.random())
    return i if ids is None else int(ids[i])


def token_logprobs(row: np.ndarray, token_id: int, top_n: int) -> TokenLogprob:
    """The chosen token's logprob and the `top_n` best alternatives under log_softmax(row)."""
    m = row.max()
    lse = float(m) + float(np.log(np.exp(row - m).sum(dtype=np.float64)))
    top: dict[int, float] = {}
    if top_n > 0:
        top = {int(i): float(row[i]) - lse for i in _top_sorted(row, min(top_n, row.shape[0]))}
    return TokenLogprob(token_id=int(token_id), logprob=float(row[token_id]) - lse, top=top)


class Sampler:
    """Chooses one token per row of a logits batch.

    Logprobs are those of the raw model distribution, log_softmax(logits), before penalties,
    temperature and filtering (as vLLM returns by default), so they do not depend on sampling settings.
    """

    def sample(self, logits: np.ndarray, states: Sequence[SequenceSamplingState]) -> SamplerOutput:
        """Choose a token for each row of `logits` `[B, V]` and record it in the row's state.

        A row that raises is reported in the output's `errors` (its state untouched); the others go on.
        """
        assert logits.ndim == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
        # (each numpy call costs a decode step ~5-40 us, its code and data evicted by the step's weights: the
        # common greedy path makes as few as it can)
        if logits.dtype != np.float32:
            logits = logits.astype(np.float32)
        errors: dict[int, Exception] = {}
        if all(s.params.greedy and s.plain for s in states):
            token_ids = logits.argmax(axis=-1)  # [B] (intp: int64), the common greedy path
            if all(s.params.logprobs is None for s in states):  # and nothing else to compute
                for state, token in zip(states, token_ids.tolist(), strict=True):
                    state.append(token)
                return SamplerOutput(token_ids=token_ids, logprobs=[None] * len(states))
        else:
            token_ids = np.zeros(len(states), dtype=np.int64)
            for i, s in enumerate(states):
                try:
                    token_ids[i] = self._choose(logits[i], s)
                except Exception as e:  # one row's failure must not fail the batch
                    errors[i] = e
        logprobs: list[TokenLogprob | None] = []
        for i, (row, state, token) in enumerate(zip(logits, states, token_ids.tolist(), strict=True)):
            n = state.params.logprobs
            try:
                logprobs.append(None if n is None or i in errors else token_logprobs(row, token, n))
                if state.grammar is not None and i not in errors:
                    state.grammar.advance(token)  # and the next mask starts computing, beside the engine step
            except Exception as e:
                errors[i] = e
                logprobs.append(None)
            if i not in errors:
                state.append(token)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, errors=errors)

    @staticmethod
    def _choose(raw: np.ndarray, state: SequenceSamplingState) -> int:
        params, row, fallback = state.params, raw, raw
        if params.has_penalties or state.blocks_now or state.bias_ids.size:
            row = raw.copy()
            apply_penalties(row, state)
        if state.grammar is not None:  # never an unconstrained token: the fallback is masked too
            mask = state.grammar.mask()
            masked = apply_mask(row, mask)
            if not np.isfinite(masked.max()):  # (rare) every allowed token penalised away, or non-finite logits
                masked = finite_allowed(masked, apply_mask(raw, mask) if row is not raw else masked)
            row = fallback = masked
        if params.greedy:
            return int(np.argmax(row))
        return sample_row(finite_row(row, fallback), params, state.rng)
