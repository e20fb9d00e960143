"""Constrained decoding: a request's JSON schema, regular expression or grammar as a per-token mask (llguidance).

`GrammarCompiler` turns a request's constraint into a checked llguidance matcher, once per distinct constraint
(a cache of pristine matchers, each request gets a copy). `GrammarState` is one sequence's matcher: after the
sampler takes a token, `advance` consumes it and starts computing the next mask on a worker thread, so that
mask is ready by the time the next engine step's logits are (the engine call releases the GIL); `allowed`
waits for it. llguidance was chosen over xgrammar because xgrammar requires torch (docs/structured_outputs.md).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmc.errors import InputError, one_line

# JSON as Python's json.dumps writes it (what models were trained on): no free whitespace, which a model could
# otherwise repeat until max_tokens.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CONSTRAINT_CHARS = 200_000  # a schema, regex or grammar longer than this is refused before compiling
_CACHE_SIZE = 256  # distinct constraints kept compiled
_MASK_WORKERS = 2


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: kind is "json_schema", "regex" or "grammar" (Lark or GBNF); `param` is
    the request field named in errors."""

    kind: str
    text: str
    param: str

    @classmethod
    def of(cls, json_schema: dict[str, Any] | str | None, regex: str | None, grammar: str | None,
           param: str | None = None) -> Constraint | None:
        """The one constraint among the three (at most one may be set; validated by SamplingParams)."""
        if json_schema is not None:
            try:
                text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
            except (TypeError, ValueError) as e:  # a set, an object, a NaN...: not JSON
                raise InputError(f"{param or 'json_schema'} is not JSON: {e}", param or "json_schema") from None
            return cls("json_schema", text, param or "json_schema")
        if regex is not None:
            return cls("regex", regex, param or "regex")
        if grammar is not None:
            return cls("grammar", grammar, param or "grammar")
        return None


def _grammar_text(c: Constraint) -> str:
    """The llguidance grammar for a constraint; raises InputError for one that is not even well-formed."""
    import llguidance

    if len(c.text) > MAX_CONSTRAINT_CHARS:
        raise InputError(f"{c.param} is {len(c.text)} characters, the limit is {MAX_CONSTRAINT_CHARS}", c.param)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.text)
        except json.JSONDecodeError as e:
            raise InputError(f"{c.param} is not valid JSON: {e}", c.param) from None
        if not isinstance(schema, dict | bool):
            raise InputError(f"{c.param} must be a JSON object (a JSON schema), got {type(schema).__name__}",
                             c.param)
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS))  # type: ignore[arg-type]
    if c.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(c.text))
    try:
        return str(llguidance.grammar_from("grammar", c.text))  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise InputError(f"{c.param} does not compile: {one_line(str(e))}", c.param) from None


class GrammarCompiler:
    """Compiles constraints for one tokenizer into matchers (thread-safe; the tokenizer's token table is built at
    the first constrained request, about 0.3 s for a 49k vocabulary).

    vocab_size is the logits' width (the masks' length); tokenizer_size the ids the tokenizer knows. llguidance
    refuses a vocabulary smaller than its tokenizer's, so where a model's head is pruned (Apertus 1.5: fewer
    logits than tokens) its masks are computed over the tokenizer's ids and cut to the head's: a pruned token is
    never allowed."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int], tokenizer_size: int = 0) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.n_vocab = max(vocab_size, tokenizer_size)  # llguidance's vocabulary: its bitmasks' length
        self.eos_ids = list(eos_ids)
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self.compiled = 0  # cache misses (constraints compiled), for tests and the bench
        self.hits = 0

    def _tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance

            self._lltok = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.n_vocab,
                                                 eos_token=self.eos_ids or None)
        return self._lltok

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(_MASK_WORKERS, thread_name_prefix="llmc-mask")
            return self._executor

    def check(self, c: Constraint) -> None:
        """Compile `c` (or find it cached); raise InputError naming the problem when it does not compile."""
        self.matcher(c)

    def matcher(self, c: Constraint) -> Any:
        """A fresh matcher for `c`, copied from the cached compiled one."""
        import llguidance

        key = (c.kind, c.text)
        with self._lock:
            base = self._cache.get(key)
            if base is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return base.deep_copy()
            lltok = self._tokenizer()
        grammar = _grammar_text(c)
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error:
            raise InputError(f"{c.param}: {_describe(c)} does not compile: {one_line(error)}", c.param)
        base = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if base.is_error():
            raise InputError(f"{c.param}: {_describe(c)} does not compile: {one_line(base.get_error())}", c.param)
        _first_step(base, c, self.vocab_size, self.n_vocab)
        with self._lock:
            self._cache[key] = base
            self.compiled += 1
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return base.deep_copy()

    def state(self, c: Constraint) -> GrammarState:
        return GrammarState(self.matcher(c), self.vocab_size, self.executor(), c, self.n_vocab)


def _first_step(base: Any, c: Constraint, vocab_size: int, n_vocab: int) -> None:
    """Raise InputError when a compiled constraint fails at its first mask or its first token (a schema that
    refers only to itself, a regex whose lexer outgrows llguidance's limits: `a{1000000}`), on a copy of `base`.
    Such a constraint would otherwise fail the request only once it runs, as the decoding's fault."""
    probe = base.deep_copy()
    bitmask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    probe.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
    if not probe.is_error():
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), count=vocab_size, bitorder="little"))
        if allowed.size:
            probe.consume_token(int(allowed[0]))
    if probe.is_error():
        raise InputError(f"{c.param}: {_describe(c)} fails at its first token: {one_line(probe.get_error())}",
                         c.param)


class GrammarState:
    """One sequence's constraint: the tokens allowed next, computed ahead on a worker thread.

    The worker turns llguidance's bitmask into an additive mask (0 where allowed, -inf elsewhere), so that the
    sampler's part, on the decode loop's critical path, is one add."""

    def __init__(self, matcher: Any, vocab_size: int, executor: ThreadPoolExecutor, constraint: Constraint,
                 n_vocab: int = 0) -> None:
        self._matcher = matcher
        self._constraint = constraint
        self._vocab = vocab_size
        self._executor = executor
        # [ceil(n_vocab / 32)], bit i: token i (llguidance's vocabulary, the tokenizer's where it is the wider)
        self._bitmask = np.full((max(vocab_size, n_vocab) + 31) // 32, -1, dtype=np.int32)
        self._mask = np.zeros(vocab_size, dtype=np.float32)  # [V] 0 / -inf
        self._error: str | None = None
        self._future: Future[None] | None = None
        self.wait_s = 0.0  # time the sampler spent waiting for masks (0 when they are ready in time)
        self.compute_s = 0.0  # CPU time of the masks (on the workers, beside the engine step)
        self._done = False
        self._submit()

    @property
    def done(self) -> bool:
        """The grammar has ended (it accepted EOS, or a stop): nothing more may be generated. (Kept from the last
        `advance`: the matcher must not be touched while a worker computes its mask.)"""
        return self._done

    def mask(self) -> np.ndarray:
        """`[V]` float32: 0 for the tokens the constraint allows next, -inf for the others. Raises InputError (the
        constraint's fault: it outgrew llguidance's limits while decoding) when the matcher failed."""
        if self._future is not None:
            t0 = time.perf_counter()
            self._future.result()
            self.wait_s += time.perf_counter() - t0
            self._future = None
        if self._error is not None:
            raise self._fault(self._error)
        return self._mask

    def allowed(self) -> np.ndarray:
        """`[V]` bool: the tokens the constraint allows next."""
        return self.mask() == 0

    def advance(self, token_id: int) -> None:
        """Consume the chosen token and start computing the next mask (unless the grammar ended)."""
        if self._future is not None:  # a token consumed without its mask having been used (not the sampler)
            self._future.result()
            self._future = None
        if not self._matcher.consume_token(int(token_id)):
            raise self._fault(f"token {token_id}: {one_line(self._matcher.get_error())}")
        self._done = bool(self._matcher.is_stopped())
        if not self._done:
            self._submit()

    def _fault(self, error: str) -> InputError:
        c = self._constraint
        return InputError(f"{c.param}: {_describe(c)} failed while decoding: {error}", c.param)

    def _submit(self) -> None:
        self._future = self._executor.submit(self._compute)

    def _compute(self) -> None:
        t0 = time.thread_time()
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self._matcher.is_error():
            self._error = one_line(self._matcher.get_error())
        bits = np.unpackbits(self._bitmask.view(np.uint8), count=self._vocab, bitorder="little")  # [V] 0 / 1
        np.take(_ADDITIVE, bits, out=self._mask)
        self.compute_s += time.thread_time() - t0


_ADDITIVE = np.array([-np.inf, 0.0], dtype=np.float32)  # bit -> what it adds to a logit


def apply_mask(row: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`row` `[V]` plus an additive mask (a new array): every token not allowed at -inf (a +inf logit there becomes
    NaN, which the sampler treats as not allowed)."""
    with np.errstate(invalid="ignore"):
        return row + mask[: row.shape[0]]


def _describe(c: Constraint) -> str:
    return {"json_schema": "the JSON schema", "regex": "the regular expression"}.get(c.kind, "the grammar")


