"""A model ready for graph building: its spec, canonical weights and rotary frequencies (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.manifest import ModelSpec

INV_FREQ = "rope.inv_freq"  # [D/2] fp32, stored beside the weights for rope models


@dataclass(frozen=True)
class Checkpoint:
    """Canonical weights: MatMul weights as [in, out]; q/k/v and gate/up fused; names as in `weights.bin`."""

    spec: ModelSpec
    weights: dict[str, np.ndarray]

    @property
    def inv_freq(self) -> np.ndarray | None:
        return self.weights.get(INV_FREQ)
