"""Weights on GGUF's quantization grids, for the quantization tests."""

from __future__ import annotations

import numpy as np


def q4_1_like(rng: np.random.Generator, k: int, n: int, fp16: bool = False) -> np.ndarray:
    """GGUF Q4_1's grid: per block of 32 along K, w = d * q + m with q in 0..15 using its whole range (as Q4_1's
    quantizer makes it); `fp16`: d and m fp16 values, as the GGUF stores them."""
    d = rng.random((k // 32, n)).astype(np.float32) * 0.1 + 0.01
    m = rng.standard_normal((k // 32, n)).astype(np.float32) * 0.3
    if fp16:
        d, m = d.astype(np.float16).astype(np.float32), m.astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (k // 32, 32, n))
    q[:, 0, :], q[:, 1, :] = 0, 15
    return (q * d[:, None, :] + m[:, None, :]).reshape(k, n).astype(np.float32)


def q8_0_like(rng: np.random.Generator, k: int, n: int, fp16: bool = False) -> np.ndarray:
    """GGUF Q8_0's grid: per block of 32 along K, w = d * q with q in -127..127 (127 in each block, as Q8_0's
    quantizer makes it); `fp16`: d fp16 values, as the GGUF stores them."""
    d = rng.random((k // 32, n)).astype(np.float32) * 0.01 + 0.001
    if fp16:
        d = d.astype(np.float16).astype(np.float32)
    q = rng.integers(-127, 128, (k // 32, 32, n))
    q[:, 0, :] = 127
    return (q * d[:, None, :]).reshape(k, n).astype(np.float32)


def q4_0_like(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    """GGUF Q4_0's grid: per block of 32 along K, w = d * (q - 8) with q in 0..15, the block's largest |w| at q = 0
    (d = that w / -8: negative where it is positive) and q = 15 reached by chance only, as Q4_0's quantizer makes
    it; d fp16, as the GGUF stores it."""
    d = (rng.standard_normal((k // 32, n)) * 0.05).astype(np.float16).astype(np.float32)
    q = rng.integers(1, 15, (k // 32, 32, n))
    q[:, 0, :] = 0
    return ((q - 8) * d[:, None, :]).reshape(k, n).astype(np.float32)


def q4_k_like(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    """GGUF Q4_K's grid: per super-block of 256 along K, fp16 d and dmin; per block of 32, 6-bit sc and m, w =
    d * sc * q - dmin * m with q in 0..15 (its whole range here). The block's scale d * sc and min dmin * m are
    products fp16 does not always hold."""
    sb = k // 256
    d = (rng.random((sb, 1, n)) * 0.002 + 0.0005).astype(np.float16).astype(np.float32)
    dmin = (rng.random((sb, 1, n)) * 0.002 + 0.0005).astype(np.float16).astype(np.float32)
    sc, m = rng.integers(1, 64, (sb, 8, n)), rng.integers(0, 64, (sb, 8, n))
    q = rng.integers(0, 16, (sb, 8, 32, n))
    q[:, :, 0], q[:, :, 1] = 0, 15
    return ((d * sc)[:, :, None] * q - (dmin * m)[:, :, None]).reshape(k, n).astype(np.float32)


def q5_like(rng: np.random.Generator, k: int, n: int, symmetric: bool) -> np.ndarray:
    """GGUF Q5_1's grid (w = d * q + m, q in 0..31 using its whole range) or Q5_0's (`symmetric`: w = d (q - 16), the
    block's largest |w| at q = 0), per block of 32 along K; d and m fp16."""
    d = (rng.random((k // 32, n)) * 0.05 + 0.005).astype(np.float16).astype(np.float32)
    if symmetric:
        d *= rng.choice([-1.0, 1.0], (k // 32, n)).astype(np.float32)
        q = rng.integers(1, 31, (k // 32, 32, n))
        q[:, 0, :] = 0
        return ((q - 16) * d[:, None, :]).reshape(k, n).astype(np.float32)
    m = (rng.standard_normal((k // 32, n)) * 0.3).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 32, (k // 32, 32, n))
    q[:, 0, :], q[:, 1, :] = 0, 31
    return (q * d[:, None, :] + m[:, None, :]).reshape(k, n).astype(np.float32)
