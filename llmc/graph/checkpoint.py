"""A model ready for graph building: its spec, canonical weights and rotary frequencies (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.manifest import ModelSpec

INV_FREQ = "rope.inv_freq"  # [R/2] fp32 (R rotated dims of a head), stored beside the weights for rope models
INV_FREQ_LOCAL = "rope.local.inv_freq"  # sliding layers' own table (Gemma 3), when they have one
INV_FREQ_LONG = "rope.long.inv_freq"  # longrope: the long-factor table, for rows past `rope_long_after` positions
XIELU = "xielu.params"  # [4] fp32 a layer (under layers.{i}.): xIELU's alpha_p, alpha_n (as applied), beta, eps
ROPE_TABLES = (INV_FREQ, INV_FREQ_LOCAL, INV_FREQ_LONG)  # kept in fp32 in every export


@dataclass(frozen=True)
class Checkpoint:
    """Canonical weights: MatMul weights as [in, out]; q/k/v and gate/up fused; names as in `weights.bin`."""

    spec: ModelSpec
    weights: dict[str, np.ndarray]

    @property
    def inv_freq(self) -> np.ndarray | None:
        return self.weights.get(INV_FREQ)
