"""Weight-only block quantization into ONNX Runtime's MatMulNBits layout (numpy only).

Symmetric per block of `block_size` input rows: q = round(w / scale) + 2^(bits-1), scale = max|w| / (2^(bits-1) - 1).
Layout for a weight W [K, N] used as x @ W: qweight [N, ceil(K / block), block * bits / 8] uint8 (4-bit: two values a
byte, low nibble first), scales [N * blocks] fp32; the zero point is the default 2^(bits-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QWEIGHT, SCALES = ".qweight", ".scales"


@dataclass(frozen=True)
class QuantSpec:
    bits: int  # 4 or 8
    block_size: int = 32
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations (fastest on CPU), 0 = fp32 compute

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")


def quantize(w_kn: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray]:
    """W [K, N] -> (qweight [N, blocks, blob] uint8, scales [N * blocks] fp32)."""
    k, n = w_kn.shape
    blocks = -(-k // spec.block_size)
    w = np.zeros((n, blocks * spec.block_size), np.float32)
    w[:, :k] = w_kn.T
    w = w.reshape(n, blocks, spec.block_size)
    qmax = 2 ** (spec.bits - 1) - 1
    scales = np.abs(w).max(axis=2) / qmax  # [N, blocks]
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(w / scales[..., None]), -qmax - 1, qmax).astype(np.int16) + qmax + 1
    q = q.astype(np.uint8)
    if spec.bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return np.ascontiguousarray(q), scales.astype(np.float32).reshape(-1)


def dequantize(qweight: np.ndarray, scales: np.ndarray, k: int, spec: QuantSpec) -> np.ndarray:
    """The inverse of `quantize` (for tests and error reports): -> W [K, N] fp32."""
    n, blocks, _ = qweight.shape
    if spec.bits == 4:
        q = np.empty((n, blocks, spec.block_size), np.uint8)
        q[..., 0::2], q[..., 1::2] = qweight & 0xF, qweight >> 4
    else:
        q = qweight
    w = (q.astype(np.float32) - 2 ** (spec.bits - 1)) * scales.reshape(n, blocks)[..., None]
    return w.reshape(n, -1)[:, :k].T.copy()


def quantize_weights(weights: dict[str, np.ndarray], names: list[str], spec: QuantSpec) -> dict[str, np.ndarray]:
    """Replace each named [K, N] weight by its qweight/scales pair; other weights are kept as they are."""
    out = {k: v for k, v in weights.items() if k not in names}
    for name in names:
        out[name + QWEIGHT], out[name + SCALES] = quantize(weights[name], spec)
    return out
