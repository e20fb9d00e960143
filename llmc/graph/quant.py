"""Weight-only block quantization into ONNX Runtime's MatMulNBits layout (numpy only).

Per block of `block_size` input rows, asymmetric: scale = (max - min) / (2^bits - 1), zero point zp = -min / scale,
q = clip(round(w / scale + zp)). 4-bit keeps zp in fp32 (ONNX Runtime's CPU kernel takes float zero points for
4 bits): blocks along K then reproduce GGUF Q4_1 weights (block 32, scale + min) exactly. 8-bit rounds zp to uint8
(the only kind its CPU kernel takes; 256 levels make that harmless).
Layout for a weight W [K, N] used as x @ W: qweight [N, ceil(K / block), block * bits / 8] uint8 (4-bit: two values a
byte, low nibble first), scales [N * blocks] fp32, zero_points [N * blocks] fp32 (4-bit) or uint8 (8-bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QWEIGHT, SCALES, ZEROS = ".qweight", ".scales", ".zero_points"


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


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[..., M] uint8 values -> [..., ceil(M * bits / 8)] bytes (4-bit: low nibble first)."""
    if bits == 8:
        return q
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros((*q.shape[:-1], 1), np.uint8)], axis=-1)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack(packed: np.ndarray, bits: int, m: int) -> np.ndarray:
    if bits == 8:
        return packed[..., :m]
    q = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    q[..., 0::2], q[..., 1::2] = packed & 0xF, packed >> 4
    return q[..., :m]


def quantize(w_kn: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [K, N] -> (qweight [N, blocks, blob] uint8, scales [N * blocks] fp32, zero_points uint8)."""
    k, n = w_kn.shape
    blocks = -(-k // spec.block_size)
    w = np.zeros((n, blocks * spec.block_size), np.float32)
    w[:, :k] = w_kn.T
    w = w.reshape(n, blocks, spec.block_size)
    qmax = 2**spec.bits - 1
    valid = np.zeros((blocks * spec.block_size,), bool)
    valid[:k] = True
    valid = valid.reshape(blocks, spec.block_size)
    lo = np.where(valid, w, np.inf).min(axis=2)  # padding rows (K % block) do not widen the grid
    hi = np.where(valid, w, -np.inf).max(axis=2)
    scales = (hi - lo) / qmax
    scales[scales == 0] = 1.0
    zp = -lo / scales
    if spec.bits == 8:
        zp = np.clip(np.rint(zp), 0, qmax)
    q = np.clip(np.rint(w / scales[..., None] + zp[..., None]), 0, qmax).astype(np.uint8)
    zeros = zp.astype(np.float32).reshape(-1) if spec.bits == 4 else zp.astype(np.uint8).reshape(-1)
    return np.ascontiguousarray(_pack(q, spec.bits)), scales.astype(np.float32).reshape(-1), zeros


def dequantize(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray, k: int, spec: QuantSpec) -> np.ndarray:
    """The inverse of `quantize` (for tests and error reports): -> W [K, N] fp32."""
    n, blocks, _ = qweight.shape
    q = _unpack(qweight, spec.bits, spec.block_size).astype(np.float32)
    zp = zeros.reshape(n, blocks).astype(np.float32)
    w = (q - zp[..., None]) * scales.reshape(n, blocks)[..., None]
    return w.reshape(n, -1)[:, :k].T.copy()


def quantize_weights(weights: dict[str, np.ndarray], names: list[str], spec: QuantSpec) -> dict[str, np.ndarray]:
    """Replace each named [K, N] weight by its qweight/scales pair; other weights are kept as they are."""
    out = {k: v for k, v in weights.items() if k not in names}
    for name in names:
        out[name + QWEIGHT], out[name + SCALES], out[name + ZEROS] = quantize(weights[name], spec)
    return out
