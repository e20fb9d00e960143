"""A backend with no ONNX, for scheduler and engine-loop tests.

`FakeKVCache` keeps, per slot, the token ids it holds, so a test can check that every slot caches exactly its
sequence's tokens in order (slot moves, chunked prefill and leaks all show there). `FakeEngine` computes
deterministic logits from a slot's cached tokens: greedy decoding follows `next_token`, which `greedy_reference`
replays with no engine at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.engines.base import Engine, KVCache, PagedKVCache
from llmc.errors import EngineError
from llmc.manifest import EngineManifest, EngineSettings, GenerationSpec, GraphSpec, KVSpec, ModelSpec
from llmc.runtime.generator import EngineLoop
from llmc.runtime.sequence import Sequence

VOCAB = 64
EOS = 2
POISON = VOCAB - 1  # a prompt [POISON, k, ...] makes the engine fail once its slot would hold more than k tokens
_BUMP = np.float32(4.0)  # the greedy token's lead over noise in [0, 1): argmax is always next_token


def fake_manifest(vocab_size: int = VOCAB, max_positions: int = 512, eos_ids: tuple[int, ...] = (EOS,)) -> EngineManifest:
    model = ModelSpec(family="fake", hf_architecture="FakeForCausalLM", hidden_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=1, intermediate_size=8, vocab_size=vocab_size,
                      max_positions=max_positions, norm="rms", norm_eps=1e-5, activation="silu", positions="rope")
    kv = KVSpec(layout="concat", dtype="float32", num_layers=1, num_kv_heads=1, head_dim=1,
                past_key="past.{i}.key", past_value="past.{i}.value",
                present_key="present.{i}.key", present_value="present.{i}.value")
    graph = GraphSpec(file="none.onnx", inputs=(), outputs=())
    return EngineManifest(backend="fake", precision="float32", export_dir="", export_manifest_sha256="",
                          model_name="fake", model=model, kv=kv, prefill=graph, decode=graph,
                          generation=GenerationSpec(eos_token_ids=eos_ids), settings=EngineSettings(), tools={}, files={})


def next_token(history: list[int], vocab_size: int = VOCAB) -> int:
    """The greedy next token after `history` (all tokens of a sequence so far)."""
    return (sum(history) * 31 + len(history)) % vocab_size


def greedy_reference(prompt: list[int], max_tokens: int, eos_ids: tuple[int, ...] = (EOS,),
                     ignore_eos: bool = False, vocab_size: int = VOCAB) -> list[int]:
    """What a greedy request generates alone, computed without any engine or scheduler."""
    history, out = list(prompt), []
    while len(out) < max_tokens:
        token = next_token(history, vocab_size)
        out.append(token)
        history.append(token)
        if token in eos_ids and not ignore_eos:
            break
    return out


class FakeKVCache(KVCache):
    def __init__(self, num_slots: int, max_len: int) -> None:
        super().__init__(num_slots, max_len)
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]

    @property
    def nbytes(self) -> int:
        return 0

    def move(self, src: int, dst: int) -> None:
        assert src != dst, src  # dst held a released sequence: its tokens are overwritten
        self.tokens[dst], self.tokens[src] = self.tokens[src], []
        self.lengths[dst], self.lengths[src] = self.lengths[src], 0

    def free(self, slot: int) -> None:
        super().free(slot)
        self.tokens[slot] = []

    def append(self, slot: int, tokens: list[int]) -> None:
        self.tokens[slot].extend(tokens)
        self.lengths[slot] = len(self.tokens[slot])

    def history(self, slot: int) -> list[int]:
        return self.tokens[slot]


class FakePagedKVCache(PagedKVCache):
    """Token ids in blocks, read through each slot's table. `frozen(block)` (set by a test: the block manager's
    is_cached) names blocks no sequence may write: a write into one fails the test at once."""

    def __init__(self, num_slots: int, max_len: int, num_blocks: int, block_size: int) -> None:
        super().__init__(num_slots, max_len, num_blocks, block_size)
        self.pool = [[-1] * block_size for _ in range(num_blocks)]
        self.frozen: Callable[[int], bool] = lambda block: False

    @property
    def nbytes(self) -> int:
        return 0

    def history(self, slot: int) -> list[int]:
        bs, table = self.block_size, self.tables[slot]
        return [self.pool[table[t // bs]][t % bs] for t in range(int(self.lengths[slot]))]

    def append(self, slot: int, tokens: list[int]) -> None:
        bs, table, start = self.block_size, self.tables[slot], int(self.lengths[slot])
        for t, token in enumerate(tokens, start):
            block = table[t // bs]
            assert not self.frozen(block), f"slot {slot} writes position {t} into cached block {block}"
            self.pool[block][t % bs] = token
        self.lengths[slot] = start + len(tokens)


@dataclass
class EngineCall:
    kind: str  # "prefill" | "decode"
    slots: list[int]
    tokens: list[list[int]]
    failed: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


@dataclass
class FakeEngine(Engine):
    """Deterministic logits: uniform noise in [0, 1) seeded by the history, plus 4 at `next_token(history)`.

    A row whose sequence is [poison, k, ...] makes the call raise EngineError, without touching the cache, once
    that row's slot would hold more than k tokens ([POISON] alone fails at once). `on_call` sees every call
    first (a test may raise from it, e.g. KeyboardInterrupt).
    """

    vocab: int = VOCAB
    max_pos: int = 512
    eos_ids: tuple[int, ...] = (EOS,)
    poison: int = POISON
    on_call: Callable[[EngineCall], None] | None = None
    block_size: int = 0  # > 0: paged KV memory (FakePagedKVCache)
    token_bytes: int = 0  # > 0: KV bytes per token to size the memory by (few blocks in a 1 MB budget)
    calls: list[EngineCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.manifest = fake_manifest(self.vocab, self.max_pos, self.eos_ids)
        self.directory = Path("fake-engine")

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        return FakeKVCache(num_slots, max_len)

    def kv_bytes_per_token(self) -> int:
        return self.token_bytes or super().kv_bytes_per_token()

    @property
    def kv_block_size(self) -> int:
        return self.block_size

    def new_paged_kv_cache(self, num_slots: int, max_len: int, num_blocks: int) -> PagedKVCache:
        return FakePagedKVCache(num_slots, max_len, num_blocks, self.block_size)

    def prefill(self, slots: list[int], prompts: list[list[int]], kv: KVCache, *, keep: bool = True) -> np.ndarray:
        assert isinstance(kv, (FakeKVCache, FakePagedKVCache))
        for slot in slots:
            assert kv.lengths[slot] == 0 and not kv.history(slot), f"prefill into slot {slot} holding tokens"
        return self._run("prefill", slots, prompts, kv)

    def decode(self, slots: list[int], tokens: list[list[int]], kv: KVCache, *, keep: bool = True) -> np.ndarray:
        assert isinstance(kv, (FakeKVCache, FakePagedKVCache))
        for slot in slots:
            assert kv.lengths[slot] > 0, f"decode into empty slot {slot}"
        return self._run("decode", slots, tokens, kv)

    def _run(self, kind: str, slots: list[int], rows: list[list[int]],
             kv: FakeKVCache | FakePagedKVCache) -> np.ndarray:
        assert len(set(slots)) == len(slots) == len(rows), (slots, rows)
        assert all(0 <= s < kv.num_slots for s in slots) and all(rows), (slots, rows)
        call = EngineCall(kind, list(slots), [list(r) for r in rows])
        self.calls.append(call)
        if self.on_call is not None:
            self.on_call(call)
        kv.check_room(slots, [len(r) for r in rows])
        histories = [kv.history(s) + list(r) for s, r in zip(slots, rows)]
        if any(h[0] == self.poison and len(h) > (h[1] if len(h) > 1 else 0) for h in histories):
            call.failed = True
            raise EngineError("fake engine: poisoned row")
        for slot, row in zip(slots, rows):
            kv.append(slot, list(row))
        return np.stack([self.logits(h) for h in histories])  # [B, V]

    def logits(self, history: list[int]) -> np.ndarray:
        rng = np.random.default_rng([len(history), sum(history), history[-1]])
        row = rng.random(self.vocab, dtype=np.float32)
        row[next_token(history, self.vocab)] += _BUMP
        return row

    def tokens_per_call(self) -> list[int]:
        return [c.num_tokens for c in self.calls if not c.failed]


def expected_cache(seq: Sequence) -> list[int]:
    """The tokens a running sequence's slot must hold: the prompt (and, resumed after a preemption, its output)
    so far, or the prompt and all but the last generated token (which is fed at the next decode)."""
    return seq.token_ids[: seq.kv_len]


def check_invariants(loop: EngineLoop) -> None:
    """Running sequences own slots 0..n-1, each slot caches exactly its sequence's tokens, the rest are empty;
    with paged memory: every block is free, cached or held as often as tables hold it, tables match the
    sequences', and every cached block still holds the tokens it was named for."""
    sched, kv = loop.scheduler, loop.kv
    assert isinstance(kv, (FakeKVCache, FakePagedKVCache))
    running = sched.running
    assert sched.slots.used == len(running) <= sched.config.max_running
    assert sorted(s.slot for s in running) == list(range(len(running)))
    for seq in running:
        assert not seq.finished, f"{seq.seq_id} finished but still running"
        assert kv.history(seq.slot) == expected_cache(seq), f"slot {seq.slot} of {seq.seq_id}"
        assert seq.table is not None and len(seq.table.blocks) * sched.config.block_size >= seq.kv_len
    for slot in range(len(running), kv.num_slots):
        assert kv.lengths[slot] == 0 and not kv.history(slot), f"slot {slot} leaks {kv.history(slot)}"
    for seq in sched.waiting:
        assert seq.slot == -1 and seq.prefilled == 0 and seq.table is None
        assert len(seq.output_ids) == seq.recompute
    check_blocks(loop)


def check_blocks(loop: EngineLoop) -> None:
    sched, kv, bm = loop.scheduler, loop.kv, loop.scheduler.blocks
    held = [0] * bm.num_blocks
    for seq in sched.running:
        assert seq.table is not None
        for b in seq.table.blocks:
            held[b] += 1
    assert held == bm.refs, "a block is leaked or owned twice"
    assert len(set(bm.free)) == len(bm.free) and not set(bm.free) & set(bm.evictable)
    assert all((b in bm.evictable) == (held[b] == 0 and bm.is_cached(b)) for b in range(bm.num_blocks))
    assert len(bm.free) + len(bm.evictable) + sum(1 for h in held if h) == bm.num_blocks
    if isinstance(kv, FakePagedKVCache):
        for seq in sched.running:
            assert seq.table is not None and kv.tables[seq.slot] == seq.table.blocks
        for b, h in enumerate(bm.block_hash):
            if h is not None:
                assert tuple(kv.pool[b]) == bm.block_tokens[b], f"cached block {b} was overwritten"
