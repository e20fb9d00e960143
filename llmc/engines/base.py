"""The one narrow interface every backend implements (ONNX Runtime, TensorRT, fakes in tests).

The runtime talks in slots and token ids; how a backend lays out KV memory and binds it is its own business.
A slot is one row of the KV cache; a running sequence owns one slot and its tokens sit at positions
0..length-1 of that row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import InputError, LimitError
from llmc.manifest import EngineManifest


@dataclass(frozen=True)
class EngineOptions:
    """Run-time settings of an engine (not what it was built with)."""

    threads: int = 0  # 0: the engine's recorded default (physical cores)
    kv_budget_mb: int = 1024  # memory for the KV cache; its blocks (or slots x max_len) are sized from it
    kv_block_size: int = 64  # tokens per KV block, where the engine pages its KV memory (why 64: docs/kv_cache.md)

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise InputError(f"--threads must be >= 0 (0 = physical cores), got {self.threads}", "threads")
        if self.kv_budget_mb < 1:
            raise InputError(f"--kv-budget-mb must be >= 1, got {self.kv_budget_mb}", "kv_budget_mb")
        if not 1 <= self.kv_block_size <= 256 or self.kv_block_size & (self.kv_block_size - 1):
            raise InputError(f"--kv-block-size must be a power of 2 from 1 to 256, got {self.kv_block_size}",
                             "kv_block_size")


class KVCache(ABC):
    """KV memory for `num_slots` sequences of up to `max_len` tokens, allocated once.

    `lengths[slot]` is how many tokens of that slot are cached. Moving a slot (to keep running sequences in slots
    0..n-1) copies one sequence once; nothing here copies the whole cache per step.
    """

    def __init__(self, num_slots: int, max_len: int) -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        self.lengths = np.zeros(num_slots, dtype=np.int64)

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    @abstractmethod
    def move(self, src: int, dst: int) -> None:
        """Copy slot src's cached tokens into slot dst (and its length); src is then free."""

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0

    def prefault(self, threads: int = 1) -> int:
        """Map and zero every page of this memory now (a server at start-up), not when the first requests' steps
        write into it; returns the bytes touched. Device memory is written when it is allocated: nothing to do."""
        return 0

    def check_room(self, slots: list[int], new_tokens: list[int]) -> None:
        for slot, n in zip(slots, new_tokens):
            need = int(self.lengths[slot]) + n  # (Python ints: numpy's scalar arithmetic costs a decode step more)
            if need > self.max_len:
                raise LimitError(f"sequence in slot {slot} needs {need} positions, KV cache holds {self.max_len}")


class PagedKVCache(KVCache):
    """KV memory in `num_blocks` blocks of `block_size` positions shared by all slots: token t of slot s sits in
    block tables[s][t // block_size] at t % block_size. The runtime's block manager chooses the tables (shared
    prefix blocks included) and sets them before each call; a slot move moves a table, never a token."""

    def __init__(self, num_slots: int, max_len: int, num_blocks: int, block_size: int) -> None:
        super().__init__(num_slots, max_len)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]

    def move(self, src: int, dst: int) -> None:
        self.tables[dst], self.tables[src] = self.tables[src], []
        self.lengths[dst], self.lengths[src] = self.lengths[src], 0

    def free(self, slot: int) -> None:
        super().free(slot)
        self.tables[slot] = []

    def check_room(self, slots: list[int], new_tokens: list[int]) -> None:
        super().check_room(slots, new_tokens)
        for slot, n in zip(slots, new_tokens):
            need, blocks = int(self.lengths[slot]) + n, len(self.tables[slot])
            if need > blocks * self.block_size:
                raise LimitError(f"sequence in slot {slot} needs {need} positions, its {blocks} blocks hold "
                                 f"{blocks * self.block_size}")


class Engine(ABC):
    """A prefill engine and a decode-with-past engine behind one interface."""

    manifest: EngineManifest
    directory: Path
    threads: int = 0

    @property
    def vocab_size(self) -> int:
        """The ids the model takes (its embeddings' rows)."""
        return self.manifest.model.vocab_size

    @property
    def logits_size(self) -> int:
        """The logits' width: the ids the model can produce (fewer than vocab_size where its head is pruned)."""
        return self.manifest.model.logits_size

    @property
    def max_positions(self) -> int:
        return self.manifest.model.max_positions

    @abstractmethod
    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache: ...

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block where this engine pages its KV memory (new_paged_kv_cache); 0: the slot layout."""
        return 0

    def new_paged_kv_cache(self, num_slots: int, max_len: int, num_blocks: int) -> PagedKVCache:
        raise NotImplementedError(f"{type(self).__name__} keeps the slot layout")

    def kv_bytes_per_token(self) -> int:
        return self.manifest.kv.bytes_per_token()

    def state_bytes_per_sequence(self) -> int:
        """The states a sequence keeps beside its KV cache (KVSpec.states: convolutions' last inputs, Gated
        DeltaNet's recurrent state), fp32."""
        return sum(4 * s.count * int(np.prod(s.shape)) for s in self.manifest.kv.states)

    @abstractmethod
    def prefill(self, slots: list[int], prompts: list[list[int]], kv: KVCache, *, keep: bool = True) -> np.ndarray:
        """Run whole prompts into empty slots; returns next-token logits [B, V] (float32). keep=False: they may be
        the engine's own output buffer, overwritten by its next call (for a caller that reads them at once: the
        engine loop's sampler; a decode step then copies no logits)."""

    @abstractmethod
    def decode(self, slots: list[int], tokens: list[list[int]], kv: KVCache, *, keep: bool = True) -> np.ndarray:
        """Append tokens (usually one each; more for a prefill chunk) to non-empty slots.

        Returns the logits after each row's last new token [B, V] (float32); keep as in `prefill`.
        """
