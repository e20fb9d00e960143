"""Weight-only block quantization for ONNX Runtime's MatMulNBits, in an exact "scale + min" form (numpy only).

Per block of `block_size` input rows (K) and output column n: w = s * q + m, with s = (max - min) / (2^bits - 1),
m = min, q = round((w - m) / s). MatMulNBits computes x @ (s * (q - z)) with its default zero point z = 2^(bits-1)
(its fast path: a float zero point is ~40x slower on CPU, a rounded uint8 one shifts every weight by up to s/2), so
each quantized linear adds the block offsets separately: x @ W = MatMulNBits(x) + blocksum(x) @ O, O = m + z * s.
This reproduces GGUF Q4_1 weights (block 32, scale + min along K) exactly, for 0.125 extra bytes per weight.

Layout for W [K, N] used as x @ W: qweight [N, K / block, block * bits / 8] uint8 (4-bit: two values a byte, low
nibble first), scales [N * blocks] fp32, offsets [blocks, N] fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmc.errors import InputError

QWEIGHT, SCALES, OFFSETS = ".qweight", ".scales", ".offsets"


@dataclass(frozen=True)
class QuantSpec:
    bits: int  # 4 or 8
    block_size: int = 32
    head_bits: int = 8  # the LM head stays at 8 bits (as llama.cpp keeps output.weight wider): it dominates int4 error
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations (fastest on CPU), 0 = fp32 compute
    scheme: str = "auto"  # "symmetric" (no offsets, fastest), "minmax" (scale + min), "auto": symmetric where that
    # reproduces a weight exactly (e.g. GGUF Q8_0), else minmax

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.head_bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits} / head {self.head_bits}")
        if self.scheme not in ("auto", "minmax", "symmetric"):
            raise ValueError(f"scheme must be auto, minmax or symmetric, got {self.scheme!r}")

    def for_bits(self, bits: int) -> QuantSpec:
        return QuantSpec(bits, self.block_size, self.head_bits, self.accuracy_level, self.scheme)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[..., M] values < 2^bits -> [..., M * bits / 8] bytes (4-bit: low nibble first)."""
    return q if bits == 8 else q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    q = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    q[..., 0::2], q[..., 1::2] = packed & 0xF, packed >> 4
    return q


def quantize(w_kn: np.ndarray, spec: QuantSpec, name: str = "weight") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [K, N] -> (qweight [N, blocks, blob] uint8, scales [N * blocks] fp32, offsets [blocks, N] fp32)."""
    k, n = w_kn.shape
    if k % spec.block_size:
        raise InputError(f"{name}: input size {k} is not a multiple of --block-size {spec.block_size}")
    blocks = k // spec.block_size
    w = np.ascontiguousarray(w_kn.T, dtype=np.float32).reshape(n, blocks, spec.block_size)
    qmax = 2**spec.bits - 1
    if spec.scheme != "minmax":  # w = s * (q - z), z = 2^(bits-1) implicit: no offsets
        half = 2 ** (spec.bits - 1)
        scales = np.abs(w).max(axis=2) / (half - 1)  # as GGUF Q8_0: q in [-(half-1), half-1]
        scales[scales == 0] = 1.0
        q = np.clip(np.rint(w / scales[..., None]) + half, 0, qmax).astype(np.uint8)
        packed, flat = np.ascontiguousarray(_pack(q, spec.bits)), scales.reshape(-1)
        err = np.abs((q.astype(np.float32) - half) * scales[..., None] - w).max()
        if spec.scheme == "symmetric" or err <= 1e-5 * max(float(np.abs(w).max()), 1e-12):
            return packed, flat, np.zeros((0, n), np.float32)
    lo, hi = w.min(axis=2), w.max(axis=2)  # [N, blocks]
    scales = (hi - lo) / qmax
    scales[scales == 0] = 1.0
    q = np.clip(np.rint((w - lo[..., None]) / scales[..., None]), 0, qmax).astype(np.uint8)
    offsets = lo + 2 ** (spec.bits - 1) * scales  # cancels the kernel's implicit zero point
    return np.ascontiguousarray(_pack(q, spec.bits)), scales.reshape(-1), np.ascontiguousarray(offsets.T)


def dequantize(qweight: np.ndarray, scales: np.ndarray, offsets: np.ndarray, spec: QuantSpec) -> np.ndarray:
    """What the graph computes with: -> W [K, N] fp32."""
    n, blocks, _ = qweight.shape
    q = _unpack(qweight, spec.bits).astype(np.float32) - 2 ** (spec.bits - 1)
    w = q * scales.reshape(n, blocks)[..., None]
    if offsets.size:
        w = w + offsets.T[..., None]
    return w.reshape(n, -1).T.copy()


def bits_of(qweight: np.ndarray, block_size: int) -> int:
    """The bit width a qweight [N, blocks, blob] was packed with."""
    return int(qweight.shape[2] * 8 // block_size)


def quantize_weights(weights: dict[str, np.ndarray], names: list[str], spec: QuantSpec,
                     head: str | None = None) -> dict[str, np.ndarray]:
    """Replace each named [K, N] weight by qweight/scales/offsets (`head` at spec.head_bits); others stay."""
    out = {k: v for k, v in weights.items() if k not in names and k != head}
    for name in names + ([head] if head else []):
        bits = spec.head_bits if name == head else spec.bits
        qweight, scales, offsets = quantize(weights[name], spec.for_bits(bits), name)
        out[name + QWEIGHT], out[name + SCALES] = qweight, scales
        if offsets.size:
            out[name + OFFSETS] = offsets
    return out
