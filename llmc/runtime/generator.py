"""The engine loop: schedule, run the engine, post-process. Continuous batching over one KV memory."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from llmc.engines.base import Engine, KVCache, PagedKVCache
from llmc.errors import EngineError, InputError, LimitError
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.request import CompletionOutput, FinishReason, RequestOutput, SamplingParams, TokenLogprob
from llmc.runtime.sampler import Sampler, SequenceSamplingState
from llmc.runtime.scheduler import KVOp, Scheduler, SchedulerConfig, StepPlan
from llmc.runtime.sequence import Sequence
from llmc.runtime.stopping import StopChecker
from llmc.runtime.structured import GrammarCompiler, GrammarState
from llmc.runtime.tokenizer import Tokenizer

log = logging.getLogger("llmc.runtime")

EngineCall = Callable[..., np.ndarray]  # Engine.prefill or Engine.decode


@dataclass(frozen=True)
class LoopStats:
    running: int  # sequences holding a KV slot
    waiting: int  # sequences admitted but not yet holding one
    kv_used_tokens: int
    kv_capacity_tokens: int
    kv_blocks_used: int = 0  # held by running sequences
    kv_blocks_cached: int = 0  # held by none, kept for prefix reuse
    kv_blocks_total: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache (since start)
    prefix_hit_tokens: int = 0  # of those, found there: not computed
    preemptions: int = 0


@dataclass(frozen=True)
class SeqUpdate:
    """What one sequence produced in one step (for streaming)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # for token_ids, when the request asked
    error: Exception | None = None  # with FinishReason.ERROR: the cause, when known (Sequence.error)


class EngineLoop:
    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, config: RuntimeConfig | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config or RuntimeConfig()
        self.kv, sched = self._kv_memory(engine)
        self.max_len = self.kv.max_len
        self.scheduler = Scheduler(sched)
        self.preemptions = 0
        self.sampler = Sampler()
        self.eos_ids = list(engine.manifest.generation.eos_token_ids)
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()  # checks run on the server's threads, sequences on the engine's

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of this model's constraints (JSON schema, regex, grammar), made at first use."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InputError("constrained decoding (a JSON schema, regex or grammar) needs the model's "
                                     "tokenizer")
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.engine.logits_size, self.eos_ids,
                                                 self.tokenizer.vocab_size)
            return self._grammars

    def _kv_memory(self, engine: Engine) -> tuple[KVCache, SchedulerConfig]:
        """KV memory sized from the budget: paged blocks where the engine pages, else max_running slots."""
        cfg, bs = self.config, engine.kv_block_size or 16
        budget, per_token = cfg.kv_budget_mb * 2**20, engine.kv_bytes_per_token()
        states = engine.state_bytes_per_sequence() * cfg.max_running  # (a recurrent model's rows, out of the budget)
        if states and states >= budget // 2:
            raise InputError(f"--kv-budget-mb {cfg.kv_budget_mb}: {cfg.max_running} sequences' states take "
                             f"{states / 2**20:,.0f} MiB of it (the model's recurrent layers keep "
                             f"{engine.state_bytes_per_sequence() / 2**20:,.1f} MiB a sequence); raise the budget to "
                             f"at least {2 * states / 2**20:,.0f} or lower --max-running", "kv_budget_mb")
        budget -= states
        if not per_token:  # (no layer attends: Mamba-2 alone; the states are all a sequence keeps)
            max_len = int(engine.max_positions)
            num_blocks = cfg.max_running * -(-max_len // bs) if engine.kv_block_size else 0
        elif engine.kv_block_size:
            num_blocks = budget // (per_token * bs)
            max_len = int(min(engine.max_positions, num_blocks * bs))
        else:
            num_blocks, max_len = 0, int(min(engine.max_positions, budget // (per_token * cfg.max_running)))
        if max_len < 16:
            raise InputError(
                f"--kv-budget-mb {cfg.kv_budget_mb} leaves {max_len} tokens per sequence for "
                f"{cfg.max_running} sequences; raise the budget or lower --max-running"
            )
        rope_long = engine.manifest.model.rope_long_after  # longrope: a prompt runs whole, never after a prefix
        sched = SchedulerConfig(cfg.max_running, max_len, cfg.max_step_tokens, cfg.min_chunk,
                                whole_prompts_over=rope_long, num_blocks=int(num_blocks), block_size=bs,
                                # (a layer's state, LFM2's convolutions, is not in the blocks: a prefix is computed again)
                                prefix_caching=cfg.prefix_caching and not rope_long and not engine.manifest.kv.states)
        kv = (engine.new_paged_kv_cache(cfg.max_running, max_len, int(num_blocks)) if num_blocks
              else engine.new_kv_cache(cfg.max_running, max_len))
        if cfg.kv_prefault:
            t0 = time.perf_counter()
            mapped = kv.prefault(engine.threads or 1)
            if mapped:
                log.info("KV memory: %.0f MB mapped at start-up in %.1f s", mapped / 2**20, time.perf_counter() - t0)
        return kv, sched

    # -- requests ----------------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):  # (from Python: a dict of its fields, a list for one prompt)
            raise InputError(f"params must be a SamplingParams, got {type(params).__name__}", "params")
        params.validate(self.engine.vocab_size, self.engine.logits_size)
        if not prompt_ids:
            raise InputError("prompt is empty: at least 1 token is needed", "prompt")
        if len(prompt_ids) > self.max_len:  # first: a huge prompt is refused without a pass over its ids
            raise LimitError(f"prompt has {len(prompt_ids)} tokens, the context holds {self.max_len}", "prompt")
        vocab = self.engine.vocab_size
        for t in prompt_ids:  # the first id that is not one, or outside the vocabulary
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                raise InputError(f"prompt token ids must be integers, got {t!r}", "prompt")
            if not 0 <= t < vocab:
                raise InputError(f"prompt token id {t} is outside the vocabulary [0, {vocab})", "prompt")
        if len(prompt_ids) + params.max_tokens > self.max_len:
            raise LimitError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(prompt_ids) + params.max_tokens} exceeds the context of {self.max_len} tokens", "max_tokens")
        constraint = params.constraint
        if constraint is not None:  # compiled once per distinct constraint, then cached
            self.grammars.check(constraint)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        self.check_request(prompt_ids, params)
        if request_id is None:
            request_id = next(r for r in (f"req-{i}" for i in self._ids) if r not in self.requests)
        elif request_id in self.requests:
            raise InputError(f"request id {request_id!r} is already in use")
        seqs = []
        for i in range(params.n):
            p = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            detok = self.tokenizer.decode_stream(prompt_ids) if self.tokenizer is not None else None
            state = SequenceSamplingState(p, prompt_ids, self.eos_ids, self._grammar_state(p))
            seq = Sequence(f"{request_id}/{i}", request_id, i, list(prompt_ids), p, state,
                           StopChecker(p, self.eos_ids), detok)
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        return request_id

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """A sequence's own matcher; its first mask is computed meanwhile, beside the prompt's prefill."""
        constraint = params.constraint
        return None if constraint is None else self.grammars.state(constraint)

    def abort(self, request_id: str) -> None:
        for seq in self.scheduler.abort(request_id):
            self._release(seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the step ----------------------------------------------------------------------------------------
    def step(self) -> list[SeqUpdate]:
        plan = self.scheduler.schedule()
        self._follow(plan)
        sampled = self._run(plan)
        return self._postprocess(plan, sampled)

    def _follow(self, plan: StepPlan) -> None:
        """KV memory follows the plan's bookkeeping: preempted rows given up, block tables and cached prefixes."""
        for op in plan.kv_ops:
            self._apply(op)
        self.preemptions += len(plan.preempted)
        if isinstance(self.kv, PagedKVCache):
            for seq in self.scheduler.running:
                assert seq.table is not None
                self.kv.tables[seq.slot] = seq.table.blocks  # the same list: blocks added later show there
            for seq in plan.admitted:
                self.kv.lengths[seq.slot] = seq.prefilled

    def _run(self, plan: StepPlan) -> list[Sequence]:
        """Run the engine for the plan; sample for every sequence whose prompt is done. Returns those that took a
        token."""
        calls = [(self.engine.prefill, [(s, s.token_ids[:n]) for s, n in plan.prefill]),
                 (self.engine.decode, [(s, s.token_ids[s.prefilled:s.prefilled + n]) for s, n in plan.extend]),
                 (self.engine.decode, [(s, [s.output_ids[-1]]) for s in plan.decode])]
        return [seq for run, rows in calls if rows for seq in self._call(run, rows)]

    def _call(self, run: EngineCall, rows: list[tuple[Sequence, list[int]]]) -> list[Sequence]:
        """One engine call, then sampling for the rows whose prompt is done (returned).

        A failed batch is retried row by row, so an engine error fails only the sequences it comes from
        (an engine raises EngineError before it changes the KV cache).
        """
        seqs = [s for s, _ in rows]
        try:
            # (keep=False: the engine's own buffer, sampled before its next call)
            logits = run([s.slot for s in seqs], [toks for _, toks in rows], self.kv, keep=False)
        except EngineError:
            if len(rows) == 1:
                seqs[0].finish(FinishReason.ERROR)
                return []
            return [seq for row in rows for seq in self._call(run, [row])]
        for seq, toks in rows:
            if not seq.prompt_done:
                seq.prefilled += len(toks)
            self.scheduler.computed(seq)
        ready = [i for i, s in enumerate(seqs) if s.prompt_done]
        if not ready:
            return []
        # (every row, the usual case: the logits as they are, no copy of [B, vocab])
        return self._sample(logits if len(ready) == len(seqs) else logits[ready], [seqs[i] for i in ready])

    def _sample(self, logits: np.ndarray, seqs: list[Sequence]) -> list[Sequence]:
        """Sample, detokenize and check stops per row; returns the sequences that took a token. A row that
        raises ends only its own sequence (with an error), as if it had been alone."""
        out = self.sampler.sample(logits, [s.sampling for s in seqs])
        took = []
        for i, (seq, logprob) in enumerate(zip(seqs, out.logprobs)):
            if i in out.errors:
                _fail(seq, "sampling", out.errors[i])
                continue
            try:
                seq.accept(logprob)
            except Exception as e:  # a detokenizer or stop-check fault stays in its sequence
                _fail(seq, "detokenizing", e)
                continue
            took.append(seq)
        return took

    def _postprocess(self, plan: StepPlan, sampled: list[Sequence]) -> list[SeqUpdate]:
        updates = [SeqUpdate(s.request_id, s.index, s.new_text, s.output_ids[-1:], s.finish_reason,
                             s.logprobs[-1:] if s.params.logprobs is not None else [], s.error) for s in sampled]
        touched = {s.seq_id for s in sampled}
        for seq in self.release_finished():
            if seq.seq_id not in touched:
                updates.append(SeqUpdate(seq.request_id, seq.index, "", [], seq.finish_reason, error=seq.error))
        return updates

    def release_finished(self) -> list[Sequence]:
        """Free the slots of running sequences that are finished (also after a step that raised part-way)."""
        done = [seq for seq in self.scheduler.running if seq.finished]
        for seq in done:
            self._release(seq)
        return done

    def _release(self, seq: Sequence) -> None:
        op = self.scheduler.release(seq)
        if op is not None:
            self._apply(op)

    def _apply(self, op: KVOp) -> None:
        src, dst = op
        if dst is None:
            self.kv.free(src)
        else:
            self.kv.move(src, dst)

    # -- state, for the loop's drivers (AsyncEngine, LLM, the batch runner) --------------------------------------
    def stats(self) -> LoopStats:
        kv, b = self.kv, self.scheduler.blocks.stats()
        capacity = kv.num_blocks * kv.block_size if isinstance(kv, PagedKVCache) else kv.num_slots * kv.max_len
        return LoopStats(len(self.scheduler.running), len(self.scheduler.waiting), int(kv.lengths.sum()), capacity,
                         b.used, b.cached, b.num_blocks, b.queried_tokens, b.hit_tokens, self.preemptions)

    @property
    def max_running(self) -> int:
        return self.config.max_running

    def running_requests(self) -> set[str]:
        """Requests with a sequence holding a KV slot."""
        return {s.request_id for s in self.scheduler.running}

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def is_done(self, request_id: str) -> bool:
        return all(s.finished for s in self.requests[request_id])

    def finish_reasons(self, request_id: str) -> dict[int, FinishReason]:
        """The finish reasons of the request's sequences that have one (by completion index)."""
        return {s.index: s.finish_reason for s in self.requests.get(request_id, []) if s.finish_reason is not None}

    def forget(self, request_id: str) -> None:
        """Abort what still runs of a request and drop it (no result)."""
        if request_id in self.requests:
            self.abort(request_id)
            del self.requests[request_id]

    # -- results -----------------------------------------------------------------------------------------
    def result(self, request_id: str, prompt: str | None = None) -> RequestOutput:
        seqs = self.requests[request_id]
        outputs = [CompletionOutput(s.text, list(s.output_ids), s.finish_reason, s.logprobs or None, s.index, s.error)
                   for s in seqs]
        return RequestOutput(request_id, prompt, list(seqs[0].prompt_ids), outputs,
                             finished=all(s.finished for s in seqs), cached_tokens=seqs[0].cached_tokens)

    def pop(self, request_id: str) -> RequestOutput:
        out = self.result(request_id)
        del self.requests[request_id]
        return out


def _fail(seq: Sequence, stage: str, exc: Exception) -> None:
    if isinstance(exc, InputError):  # the request's fault (a constraint that failed while decoding): no traceback
        log.warning("%s failed for %s; ending that request: %s", stage, seq.seq_id, exc)
    else:
        log.error("%s failed for %s; ending that request: %s: %s", stage, seq.seq_id, type(exc).__name__, exc,
                  exc_info=exc)
    seq.error = exc
    seq.finish(FinishReason.ERROR)
