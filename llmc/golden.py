"""Golden reference outputs (written at export by transformers, read by every later stage; numpy only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

GOLDEN_FILE = "golden.npz"
GOLDEN_STEPS = 8  # greedy tokens of the golden continuation: an engine must reproduce them all


@dataclass(frozen=True)
class Golden:
    input_ids: np.ndarray  # [S] int64, the prompt
    continuation: np.ndarray  # [K] int64, transformers' greedy tokens
    logits: np.ndarray  # [K + 1, V] float32: next-token logits after the prompt and after each greedy token

    def save(self, path: Path) -> None:
        np.savez_compressed(path, input_ids=self.input_ids, continuation=self.continuation, logits=self.logits)

    @classmethod
    def load(cls, path: Path) -> Golden:
        with np.load(path) as z:
            return cls(z["input_ids"], z["continuation"], z["logits"])
