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
    kv_budget_mb: int = 1024  # memory for the KV cache; slots x max_len are sized from it

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise InputError(f"--threads must be >= 0 (0 = physical cores), got {self.threads}", "threads")
        if self.kv_budget_mb < 1:
            raise InputError(f"--kv-budget-mb must be >= 1, got {self.kv_budget_mb}", "kv_budget_mb")


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

    def check_room(self, slots: list[int], new_tokens: list[int]) -> None:
        for slot, n in zip(slots, new_tokens):
            if self.lengths[slot] + n > self.max_len:
                raise LimitError(
                    f"sequence in slot {slot} needs {self.lengths[slot] + n} positions, KV cache holds {self.max_len}"
                )


class Engine(ABC):
    """A prefill engine and a decode-with-past engine behind one interface."""

    manifest: EngineManifest
    directory: Path
    threads: int = 0

    @property
    def vocab_size(self) -> int:
        return self.manifest.model.vocab_size

    @property
    def max_positions(self) -> int:
        return self.manifest.model.max_positions

    @abstractmethod
    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache: ...

    def kv_bytes_per_token(self) -> int:
        kv = self.manifest.kv
        return 2 * kv.num_layers * kv.num_kv_heads * kv.row_width * kv.itemsize

    @abstractmethod
    def prefill(self, slots: list[int], prompts: list[list[int]], kv: KVCache) -> np.ndarray:
        """Run whole prompts into empty slots; returns next-token logits [B, V] (float32)."""

    @abstractmethod
    def decode(self, slots: list[int], tokens: list[list[int]], kv: KVCache) -> np.ndarray:
        """Append tokens (usually one each; more for a prefill chunk) to non-empty slots.

        Returns the logits after each row's last new token [B, V] (float32).
        """
