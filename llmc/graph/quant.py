"""Weight-only block quantization for ONNX Runtime's MatMulNBits, in "scale + min" form (numpy only).

Per block of `block_size` input rows (K) and output column n: w = s * q + m, with s = (max - min) / (2^bits - 1),
m = min, q = round((w - m) / s). MatMulNBits computes x @ (s * (q - z)) with its default zero point z = 2^(bits-1)
(its fast path: a float zero point is ~40x slower on CPU, a uint8 one ~1.6x slower and rounds every weight by up
to s/2), so the per-block offsets O = m + z * s are added separately: x @ W = MatMulNBits(x) + blocksum(x) @ O.
That reproduces GGUF Q4_1 weights (block 32, scale + min along K). Two ways to add the offsets:

- "minmax": an fp32 MatMul of the block sums with O [blocks, N] (exact; 5 nodes per linear layer).
- "folded": O rides in the same MatMulNBits as extra input rows. x is extended with its block sums (one small
  MatMulNBits against a constant 0/1 matrix, exact in 4 bits), and each offset is stored in those rows as a coarse
  value plus its remainder (two symmetric 4-bit rows per offset: about 8-bit precision; one 8-bit row when the
  layer is 8-bit). 3 nodes per linear layer, no fp32 weights: the fast form of the exact weights.

A third form is llmc's own (`QuantSpec.kernel == "llmc"`): 4-bit layers as their scale + min blocks as they are
(fp16 scale and min per block of 32, GGUF Q4_1's own numbers), packed in the tiles the ai.llmc.MatMulQ4 operator
reads (llmc/engines/kernels/matmul_q4.h): one node per linear layer, the min exact, and the SwiGLU MLP's gate and
up projections in one node with the gate applied (`gated`: their tiles alternate); 8-bit layers (the head, --quant
int8, layers a quality target raised) as 8-bit scale + min blocks in the same tiles, for ai.llmc.MatMulQ8: a GGUF
Q8_0 block (the tied head of a Q8_0 embedding) and a 4-bit grid (a raised GGUF Q4_1 layer) come back as they were
(up to an fp16 scale of d / 17). A 4-bit layer whose every column holds only -h, 0 and h (BitNet b1.58's ternary
weights times their scale) goes to ai.llmc.MatMulQ2 instead: the same values as 2 bits a weight with one fp32 scale
and min a column (2.03 bits a weight where the 4-bit tiles take 5), the same products.

Layout for W [K, N] used as x @ W: qweight [N, K' / block, block * bits / 8] uint8 (4-bit: two values a byte, low
nibble first), scales [N * K' / block] fp32 (K' = K, or K + the offset rows when folded), offsets [blocks, N] fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llmc.errors import InputError

QWEIGHT, SCALES, OFFSETS = ".qweight", ".scales", ".offsets"
BLOCKSUMS, BLOCKSUM_SCALES = ".blocksums", ".blocksum_scales"  # folded: the 0/1 matrix giving the block sums
BF16TILES, BF16TILES_GATED = ".bf16tiles", ".bf16tiles_gated"  # llmc's MatMulBF16 layout (gated: SwiGLU gate/up)
EMBED_Q8, EMBED_Q8_SCALES, EMBED_BF16 = ".q8", ".q8scales", ".bf16"  # the embedding's lookup table, compact
Q4TILES, Q4TILES_GATED = ".q4tiles", ".q4tiles_gated"  # llmc's MatMulQ4 layout (gated: SwiGLU gate/up tiles)
Q8TILES, Q8TILES_GATED = ".q8tiles", ".q8tiles_gated"  # llmc's MatMulQ8 layout
Q2TILES, Q2TILES_GATED = ".q2tiles", ".q2tiles_gated"  # llmc's MatMulQ2 layout (ternary columns)
# llmc's integer tile operators by their weights' suffix (a gated layer's: the suffix + "_gated")
TILE_OPS = {Q4TILES: "MatMulQ4", Q8TILES: "MatMulQ8", Q2TILES: "MatMulQ2"}
SCHEMES = ("auto", "folded", "minmax", "symmetric")
KERNELS = ("ort", "llmc")
# A linear layer's precision: 4-bit weights with int8 activations (MatMulQ4, or MatMulNBits at the spec's accuracy),
# with 16-bit ones (MatMulQ4's two-level int8 activations: the same bytes), or with fp32 ones (MatMulNBits, accuracy
# 0, the exact grid); 8-bit weights with int8 or fp32 activations; or the float weights.
# -act16: 16-bit activations (two 8-bit levels, x ~ s1 q1 + s2 q2) on the same weights; -fp32act: fp32 ones
PRECISIONS = ("int4", "int4-act16", "int4-fp32act", "int8", "int8-act16", "fp32")
TILE, TILE_BLOCK = 16, 32  # MatMulQ4: 16 columns per tile, blocks of 32 along K
# Columns a tile packer quantizes at a time (a multiple of a tile pair's 32): its float temporaries, 3-4x the
# weight's fp32 bytes, stay a few times one slice's. A 151,936-token head's 8-bit tiles took 3.95 GB of them at
# once, beside the 0.93 GB head and its contiguous transposed copy (measured); a slice of a transposed view is
# copied on its own, so the head goes in as embed.T.
COLUMN_CHUNK = 8192


@dataclass(frozen=True)
class QuantSpec:
    bits: int  # 4 or 8
    block_size: int = 32
    head_bits: int = 8  # the LM head stays at 8 bits (as llama.cpp keeps output.weight wider): it dominates int4 error
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations (fastest on CPU), 0 = fp32 compute
    scheme: str = "auto"  # "symmetric" (no offsets, fastest, lossy), "minmax" / "folded" (scale + min, see above);
    # "auto": symmetric where that reproduces a weight exactly (e.g. GGUF Q8_0), else folded
    kernel: str = "ort"  # 4-bit layers: "ort" (MatMulNBits, `scheme`) | "llmc" (ai.llmc.MatMulQ4, scale + min)
    # Per-layer precisions (PRECISIONS), where they differ from `bits` (and the head's `head_bits`): what a quality
    # target chose by measurement (llmc/engines/ort/quality.py). (name without ".weight", precision) pairs.
    layout: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, precision in self.layout:
            if precision not in PRECISIONS:
                raise ValueError(f"{name}: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if self.bits not in (4, 8) or self.head_bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits} / head {self.head_bits}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")

    def for_bits(self, bits: int) -> QuantSpec:
        return QuantSpec(bits, self.block_size, self.head_bits, self.accuracy_level, self.scheme, self.kernel)

    def precision_of(self, name: str, head: bool = False) -> str:
        """A linear layer's precision (its name without ".weight"; the head is "lm_head", or says `head`)."""
        chosen = dict(self.layout).get(name)
        if chosen is not None:
            return chosen
        return f"int{self.head_bits if head or name == 'lm_head' else self.bits}"

    def accuracy_of(self, name: str) -> int:
        """MatMulNBits' accuracy_level for a layer: 0 (fp32 activations) where its precision says so."""
        precision = self.precision_of(name)
        if precision == "int8-act16":
            return 4  # the two 8-bit levels must each be quantized exactly: int8 compute
        return 0 if precision.endswith("-fp32act") else self.accuracy_level

    def act_bits_of(self, name: str) -> int:
        """MatMulQ4's activation bits for a layer: 16 (two-level int8) where its precision says so, else 8."""
        return 16 if self.precision_of(name).endswith("-act16") else 8

    def q4_tiles(self, bits: int) -> bool:
        """Whether a layer of `bits` bits goes to llmc's MatMulQ4."""
        return self.kernel == "llmc" and bits == 4

    def q8_tiles(self, bits: int) -> bool:
        """Whether a layer of `bits` bits goes to llmc's MatMulQ8."""
        return self.kernel == "llmc" and bits == 8


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """[..., M] values < 2^bits -> [..., M * bits / 8] bytes (4-bit: low nibble first)."""
    return np.ascontiguousarray(q if bits == 8 else q[..., 0::2] | (q[..., 1::2] << 4))


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    q = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    q[..., 0::2], q[..., 1::2] = packed & 0xF, packed >> 4
    return q


def quantize_rows(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows w [..., N, K] (K along which the blocks run) at `bits` with a scale and an integer zero point a block,
    w ~ (q - z) * s (ONNX Runtime's QMoE and MatMulNBits form): (q packed [..., N, K * bits / 8], s [..., N,
    K / block], z packed [..., N, ceil(K / block * bits / 8)]). A block's range [min, max] always holds 0, so that
    its zero point is an integer in [0, 2^bits - 1] and 0 is exact."""
    *lead, n, k = w.shape
    blocks = w.reshape(*lead, n, k // block_size, block_size).astype(np.float32)
    qmax = 2**bits - 1
    lo, hi = np.minimum(blocks.min(-1), 0.0), np.maximum(blocks.max(-1), 0.0)
    scales = (hi - lo) / qmax
    scales[scales == 0] = 1.0
    zero = np.clip(np.rint(-lo / scales), 0, qmax).astype(np.uint8)
    q = np.clip(np.rint(blocks / scales[..., None]) + zero[..., None], 0, qmax).astype(np.uint8)
    if bits == 4 and zero.shape[-1] % 2:
        zero = np.concatenate([zero, np.zeros((*zero.shape[:-1], 1), np.uint8)], axis=-1)  # a whole byte a row
    return (_pack(q.reshape(*lead, n, k), bits), np.ascontiguousarray(scales.astype(np.float32)), _pack(zero, bits))


def ternary_blocks(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Which blocks (reduced along `axis`) hold only values of -h, 0 and h, h = their largest |w| > 0 (BitNet's
    ternary weights times their scale), and h: their grid is then scale h over min -h, q in {0, 1, 2}, where the usual
    (max - min) / 15 step puts 0 between two levels (-h, 0 and h), or off its fp16 multiple of the step (-h and 0)."""
    a = np.abs(w)
    h = a.max(axis=axis)
    return np.all((a == np.expand_dims(h, axis)) | (a == 0), axis=axis) & (h > 0), h


def ternary_columns(w: np.ndarray, axis: int = 0) -> bool:
    """Whether every column of w (its values along `axis`) holds only -h, 0 and h, h its own largest |w| (BitNet's
    ternary weights times their scale, or a column of zeros): MatMulQ2 holds them exactly."""
    w = np.asarray(w, np.float32)
    for rows in (np.abs(np.take(w, range(min(64, w.shape[axis])), axis=axis)), None):  # (a column's first values
        # hold one magnitude besides 0 where it is ternary: most weights fail there, before the whole is read)
        a = np.abs(w) if rows is None else rows
        if not np.all((a == a.max(axis=axis, keepdims=True)) | (a == 0)):
            return False
    return True


def _symmetric(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """w [N, blocks, block] -> (q uint8 around the implicit zero point, scales [N, blocks]); as GGUF Q8_0."""
    half = 2 ** (bits - 1)
    scales = np.abs(w).max(axis=2) / (half - 1)  # q - half in [-(half-1), half-1]
    scales[scales == 0] = 1.0
    q = np.clip(np.rint(w / scales[..., None]) + half, 0, 2**bits - 1).astype(np.uint8)
    return q, scales


def _symmetric_value(q: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    return (q.astype(np.float32) - 2 ** (bits - 1)) * scales[..., None]


def offset_rows(blocks: int, block_size: int, bits: int) -> int:
    """Extra input rows a folded layer with `blocks` blocks along K carries: each part padded to whole blocks."""
    parts = 2 if bits == 4 else 1
    return parts * -(-blocks // block_size) * block_size


def blocksum_matrix(k: int, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray]:
    """The constant E [K, rows] with x @ E = the block sums of x, once per offset part (zeros between), as an
    exact 4-bit MatMulNBits weight (values 0/1, scale 1)."""
    blocks = k // spec.block_size
    rows = offset_rows(blocks, spec.block_size, spec.bits)
    part = rows // (2 if spec.bits == 4 else 1)
    e = np.zeros((k, rows), np.float32)
    for start in range(0, rows, part):
        e[np.arange(k), start + np.arange(k) // spec.block_size] = 1.0
    q = (e.T.reshape(rows, blocks, spec.block_size) + 8).astype(np.uint8)
    return _pack(q, 4), np.ones(rows * blocks, np.float32)


def quantize(w_kn: np.ndarray, spec: QuantSpec, name: str = "weight") -> dict[str, np.ndarray]:
    """W [K, N] -> {QWEIGHT, SCALES (, OFFSETS | BLOCKSUMS + BLOCKSUM_SCALES)} as the graph uses them."""
    k, n = w_kn.shape
    bs = spec.block_size
    if k % bs:
        raise InputError(f"{name}: input size {k} is not a multiple of --block-size {bs}")
    blocks = k // bs
    w = np.ascontiguousarray(w_kn.T, dtype=np.float32).reshape(n, blocks, bs)
    qmax = 2**spec.bits - 1
    if spec.scheme in ("auto", "symmetric"):  # w = s * (q - z), z = 2^(bits-1) implicit: no offsets
        q, scales = _symmetric(w, spec.bits)
        err = np.abs(_symmetric_value(q, scales, spec.bits) - w).max()
        if spec.scheme == "symmetric" or err <= 1e-5 * max(float(np.abs(w).max()), 1e-12):
            return {QWEIGHT: _pack(q, spec.bits), SCALES: scales.reshape(-1)}
    lo, hi = w.min(axis=2), w.max(axis=2)  # [N, blocks]
    ternary, h = ternary_blocks(w, 2)
    scales = np.where(ternary, h, (hi - lo) / qmax)  # (a ternary block: q = (w - min) / h, 0 exact)
    scales[scales == 0] = 1.0
    q = np.clip(np.rint((w - lo[..., None]) / scales[..., None]), 0, qmax).astype(np.uint8)
    offsets = lo + 2 ** (spec.bits - 1) * scales  # [N, blocks]: cancels the kernel's implicit zero point
    if spec.scheme == "minmax":
        return {QWEIGHT: _pack(q, spec.bits), SCALES: scales.reshape(-1), OFFSETS: np.ascontiguousarray(offsets.T)}
    # folded: offset rows below the K weight rows; part 1 holds the offsets, part 2 (4-bit) their remainder
    rows = offset_rows(blocks, bs, spec.bits)
    parts = 2 if spec.bits == 4 else 1
    part = rows // parts
    rest = np.zeros((n, part), np.float32)
    rest[:, :blocks] = offsets
    qs, ss = [], []
    for _ in range(parts):
        qp, sp = _symmetric(rest.reshape(n, part // bs, bs), spec.bits)
        rest = rest - _symmetric_value(qp, sp, spec.bits).reshape(n, part)
        qs.append(qp)
        ss.append(sp)
    q_all = np.concatenate([q, *qs], axis=1)  # [N, blocks + rows / block, block]
    e_q, e_s = blocksum_matrix(k, spec)
    return {QWEIGHT: _pack(q_all, spec.bits), SCALES: np.concatenate([scales, *ss], axis=1).reshape(-1),
            BLOCKSUMS: e_q, BLOCKSUM_SCALES: e_s}


def _gate_up_tiles(w: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Columns [gate | up] -> alternating 16-column tiles (gate tile i, up tile i, ...), or back."""
    k, n = w.shape
    shape = (k, n // 2 // TILE, 2, TILE) if inverse else (k, 2, n // 2 // TILE, TILE)
    return np.ascontiguousarray(w.reshape(shape).transpose(0, 2, 1, 3).reshape(k, n))


def _by_columns(pack: Callable[[np.ndarray, bool, str], np.ndarray], w_kn: np.ndarray, name: str) -> np.ndarray:
    """A tile packer's result for W [K, N], COLUMN_CHUNK columns at a time: its tile pairs are independent and
    come in column order, so the slices' results stack along their first axis."""
    return np.concatenate([pack(w_kn[:, c:c + COLUMN_CHUNK], False, name)
                           for c in range(0, w_kn.shape[1], COLUMN_CHUNK)], axis=0)


def pack_q4_tiles(w_kn: np.ndarray, gated: bool = False, name: str = "weight") -> np.ndarray:
    """W [K, N] -> MatMulQ4's packed tiles [ceil(N / 32), K / 32, 640] uint8 (pairs of 16-column tiles side by side,
    per block of 32 along K; matmul_q4.h): q in 0..15 with w = scale * q + min, scale and min fp16 (min = the
    block's minimum: GGUF Q4_1's numbers come back as they were; or GGUF Q4_0's grid, where that holds a block
    exactly: its numbers come back as they were too). `gated`: W = [gate | up] of a SwiGLU MLP, its tiles
    interleaved."""
    if not gated and w_kn.shape[1] > COLUMN_CHUNK:
        return _by_columns(pack_q4_tiles, w_kn, name)
    wb = _tile_blocks(w_kn, gated, name, "4-bit")
    blocks, _, n_pad = wb.shape
    tiles = n_pad // TILE
    lo = wb.min(axis=1).astype(np.float16)  # [blocks, N]
    scales = ((wb.max(axis=1) - lo.astype(np.float32)) / 15).astype(np.float16)
    ternary, h = ternary_blocks(wb, 1)  # (BitNet's: -h, 0 and h as q = 0, 1, 2 over scale h, 0 exact)
    scales[ternary] = h[ternary].astype(np.float16)
    lo[ternary] = -scales[ternary]
    scales[scales == 0] = 1.0
    q = _on_grid(wb, scales, lo)
    # GGUF Q4_0's grid, w = d (q - 8) with the block's largest |w| at q = 0: d = that w / -8, exact in fp16 (negative
    # where that w is positive) and min = that w. Its blocks rarely reach q = 15, so the min / max grid above would
    # put their values between its steps; where this one holds a block exactly (and that one does not), it is taken.
    # (Other weights keep the min / max grid: the one every other product of the same weights is checked against.)
    top = np.take_along_axis(wb, np.abs(wb).argmax(axis=1)[:, None], axis=1)[:, 0]
    d0, lo0 = (top / -8).astype(np.float16), top.astype(np.float16)
    d0[d0 == 0] = 1.0
    q0 = _on_grid(wb, d0, lo0)
    err0 = _grid_error(wb, q0, d0, lo0)
    exact = (err0 <= 1e-6 * np.abs(top)) & (err0 < _grid_error(wb, q, scales, lo))
    q, scales, lo = np.where(exact[:, None], q0, q), np.where(exact, d0, scales), np.where(exact, lo0, lo)
    q6 = q.astype(np.uint8).reshape(blocks, 4, 2, 4, tiles, TILE)  # k = 32 b + 8 c + 4 h + i
    nibbles = (q6[:, :, 0] | (q6[:, :, 1] << 4)).transpose(3, 0, 1, 4, 2).reshape(tiles, blocks, 256)
    per_tile = [a.reshape(blocks, tiles, TILE).transpose(1, 0, 2).copy().view(np.uint8) for a in (scales, lo)]
    return _pairs(np.concatenate([nibbles, *per_tile], axis=2))  # from [tiles, blocks, 320]


def _on_grid(wb: np.ndarray, scales: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The 4-bit q of blocks [blocks, 32, N] on the grid scale * q + lo (fp16 [blocks, N])."""
    return np.clip(np.rint((wb - lo.astype(np.float32)[:, None]) / scales.astype(np.float32)[:, None]), 0, 15)


def _q8_on(wb: np.ndarray, scales: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The 8-bit q of blocks [blocks, rows, N] on the grid scale * q + lo ([blocks, N])."""
    return np.clip(np.rint((wb - lo[:, None]) / scales[:, None]), 0, 255)


def _grid_error(wb: np.ndarray, q: np.ndarray, scales: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The largest |w - (scale * q + lo)| of each block and column [blocks, N], as the kernel computes w."""
    return np.abs(q * scales.astype(np.float32)[:, None] + lo.astype(np.float32)[:, None] - wb).max(axis=1)


def _pairs(per_tile: np.ndarray) -> np.ndarray:
    """[tiles, blocks, bytes] -> [tiles / 2, blocks, 2 * bytes]: each pair of tiles side by side per block."""
    tiles, blocks, _ = per_tile.shape
    return np.ascontiguousarray(per_tile.reshape(tiles // 2, 2, blocks, -1).transpose(0, 2, 1, 3)
                                .reshape(tiles // 2, blocks, -1))


def _per_tile(packed: np.ndarray) -> np.ndarray:
    """_pairs undone."""
    pairs, blocks, _ = packed.shape
    return packed.reshape(pairs, blocks, 2, -1).transpose(0, 2, 1, 3).reshape(2 * pairs, blocks, -1)


def _tile_blocks(w_kn: np.ndarray, gated: bool, name: str, what: str) -> np.ndarray:
    """W [K, N] (gated: its gate/up tiles interleaved) as [K / 32, 32, N padded to 32 columns with zeros]."""
    k, n = w_kn.shape
    if k % TILE_BLOCK:
        raise InputError(f"{name}: input size {k} is not a multiple of the {what} kernel's block of {TILE_BLOCK}")
    if gated and n % (2 * TILE):
        raise InputError(f"{name}: gate/up width {n} is not a multiple of {2 * TILE}")
    w = _gate_up_tiles(np.asarray(w_kn, np.float32)) if gated else np.asarray(w_kn, np.float32)
    wb = np.zeros((k // TILE_BLOCK, TILE_BLOCK, -(-n // (2 * TILE)) * 2 * TILE), np.float32)
    wb[..., :n] = w.reshape(k // TILE_BLOCK, TILE_BLOCK, n)
    return wb


def pack_q8_tiles(w_kn: np.ndarray, gated: bool = False, name: str = "weight") -> np.ndarray:
    """W [K, N] -> MatMulQ8's packed tiles [ceil(N / 32), K / 32, 1152] uint8 (matmul_q4.h): per block of 32 along
    K and column, w = scale * q + min with q in 0..255, scale and min fp16. A block GGUF Q8_0's form holds exactly
    (d = max |w| / 127 in fp16, w = d * q8) is stored as scale d, min -128 d; any other as its own grid, min = the
    block's minimum and scale = (max - min) / 255, or one of GGUF's narrower grids where that holds it at least
    twice as close (below). Chunk c of a tile's block holds k = 4 c .. 4 c + 3 of its 16 columns, then the 16 scales
    and 16 mins."""
    if not gated and w_kn.shape[1] > COLUMN_CHUNK:
        return _by_columns(pack_q8_tiles, w_kn, name)
    wb = _tile_blocks(w_kn, gated, name, "8-bit")
    blocks, _, n_pad = wb.shape
    tiles = n_pad // TILE
    d = (np.abs(wb).max(axis=1) / 127).astype(np.float16).astype(np.float32)  # [blocks, N]
    q8 = np.rint(wb / np.where(d > 0, d, 1)[:, None])
    symmetric = np.all((q8 * d[:, None]).astype(np.float32) == wb, axis=1) & (np.abs(q8).max(axis=1) <= 127)
    lo = wb.min(axis=1).astype(np.float16).astype(np.float32)
    step = ((wb.max(axis=1) - lo) / 255).astype(np.float16).astype(np.float32)
    ternary, h = ternary_blocks(wb, 1)  # (BitNet's: -h, 0 and h as q = 0, 1, 2 over scale h)
    step[ternary] = h[ternary].astype(np.float16).astype(np.float32)
    lo[ternary] = -step[ternary]
    scale, low = np.where(symmetric, d, np.where(step > 0, step, 1)), np.where(symmetric, -128 * d, lo)
    q = np.clip(np.rint((wb - low[:, None]) / np.where(scale > 0, scale, 1)[:, None]), 0, 255)
    # GGUF's narrower grids on their own steps: q spanning 0..15 or 0..31 from the block's minimum (Q4_1, Q4_K,
    # Q5_1, Q5_K), or Q4_0's / Q5_0's d (q - 8 / 16) with the largest |w| at q = 0. Their steps are not the 255ths of
    # the block's range, so a block of them lies between those; one of these grids is taken where it holds the block
    # at least twice as close (exactly, for Q4_0 / Q4_1 / Q5_0 / Q5_1; to fp16's rounding of the K-quants'
    # products), which a block of other weights all but never is.
    err = _grid_error(wb, q, scale, low)
    top = np.take_along_axis(wb, np.abs(wb).argmax(axis=1)[:, None], axis=1)[:, 0]
    span = wb.max(axis=1) - lo
    for s_c, lo_c in [(span / n, lo) for n in (15, 31)] + [(top / -z, top) for z in (8, 16)]:
        s_c, lo_c = s_c.astype(np.float16).astype(np.float32), lo_c.astype(np.float16).astype(np.float32)
        s_c[s_c == 0] = 1.0
        # (a block's first 4 weights first: other weights' blocks are all but never within half the error there)
        maybe = (_grid_error(wb[:, :4], _q8_on(wb[:, :4], s_c, lo_c), s_c, lo_c) < err / 2) & ~ternary & ~symmetric
        b, c = np.nonzero(maybe)
        if not len(b):
            continue
        sub, s_m, lo_m = wb[b, :, c][..., None].transpose(1, 2, 0), s_c[b, c][None], lo_c[b, c][None]  # [32, 1, M]
        q_m = _q8_on(sub.transpose(1, 0, 2), s_m, lo_m)  # [1, 32, M]
        e_m = _grid_error(sub.transpose(1, 0, 2), q_m, s_m, lo_m)[0]
        take = e_m < err[b, c] / 2
        b, c = b[take], c[take]
        q[b, :, c], scale[b, c], low[b, c], err[b, c] = q_m[0, :, take], s_m[0, take], lo_m[0, take], e_m[take]
    q = q.astype(np.uint8)
    values = q.reshape(blocks, 8, 4, tiles, TILE).transpose(3, 0, 1, 4, 2).reshape(tiles, blocks, 512)  # k = 4 c + i
    grid = [a.astype(np.float16).reshape(blocks, tiles, TILE).transpose(1, 0, 2).copy().view(np.uint8)
            for a in (scale, low)]
    return _pairs(np.concatenate([values, *grid], axis=2))


def pack_q2_tiles(w_kn: np.ndarray, gated: bool = False, name: str = "weight") -> np.ndarray:
    """W [K, N] of ternary columns (`ternary_columns`) -> MatMulQ2's packed tiles [ceil(N / 32), K / 32 + 1, 256]
    uint8 (matmul_q4.h): w = scale * q + min with q in 0..3 and one fp32 scale and min a column (h and -h: q = 0, 1,
    2 for -h, 0, h); each tile's first row its 16 scales and 16 mins, then per block of 32 along K two chunks of 64
    bytes, byte 4 j + i of chunk c holding k = 16 c + 4 s + i of column j in bits 2 s, 2 s + 1."""
    if not gated and w_kn.shape[1] > COLUMN_CHUNK:
        return _by_columns(pack_q2_tiles, w_kn, name)
    wb = _tile_blocks(w_kn, gated, name, "2-bit")
    blocks, _, n_pad = wb.shape
    tiles = n_pad // TILE
    h = np.abs(wb).max(axis=(0, 1))  # [N padded]
    if not ternary_columns(wb.reshape(-1, n_pad)):
        raise ValueError(f"{name}: MatMulQ2 holds ternary columns only (-h, 0 and h a column)")
    q = (np.rint(wb / np.where(h > 0, h, 1)) + 1).astype(np.uint8).reshape(blocks, 2, 4, 4, tiles, TILE)  # k = 16 c + 4 s + i
    values = q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6  # [b, c, i, t, j]
    values = values.transpose(3, 0, 1, 4, 2).reshape(tiles, blocks, 2 * 64)
    grid = np.concatenate([h.reshape(tiles, TILE), -h.reshape(tiles, TILE)], axis=1).astype(np.float32)
    return _pairs(np.concatenate([grid.view(np.uint8)[:, None, :], values], axis=1))  # from [tiles, blocks + 1, 128]


def unpack_q2_tiles(packed: np.ndarray, n: int, gated: bool = False) -> np.ndarray:
    """MatMulQ2's packed tiles -> the W [K, N] fp32 they hold."""
    per_tile = _per_tile(packed)
    tiles, rows, _ = per_tile.shape
    blocks = rows - 1
    grid = per_tile[:, 0].copy().view(np.float32)  # [t, 32]: 16 scales, 16 mins
    v = per_tile[:, 1:].reshape(tiles, blocks, 2, TILE, 4)  # [t, b, c, j, i]
    q = np.stack([(v >> 2 * s) & 3 for s in range(4)], axis=3)  # [t, b, c, s, j, i]
    q = q.transpose(1, 2, 3, 5, 0, 4).reshape(blocks * TILE_BLOCK, tiles * TILE).astype(np.float32)
    w = (q * grid[:, :TILE].reshape(-1) + grid[:, TILE:].reshape(-1))[:, :n]
    return _gate_up_tiles(w, inverse=True) if gated else w


def unpack_q8_tiles(packed: np.ndarray, n: int, gated: bool = False) -> np.ndarray:
    """MatMulQ8's packed tiles -> the W [K, N] fp32 they hold."""
    per_tile = _per_tile(packed)
    tiles, blocks, _ = per_tile.shape
    q = per_tile[..., :512].reshape(tiles, blocks, 8, TILE, 4).astype(np.float32)  # [t, b, c, j, i]
    q = q.transpose(1, 2, 4, 0, 3).reshape(blocks, TILE_BLOCK, tiles * TILE)
    scales, mins = (per_tile[..., off:off + 2 * TILE].copy().view(np.float16).astype(np.float32)
                    .transpose(1, 0, 2).reshape(blocks, 1, tiles * TILE) for off in (512, 512 + 2 * TILE))
    w = (q * scales + mins).reshape(blocks * TILE_BLOCK, tiles * TILE)[:, :n]
    return _gate_up_tiles(w, inverse=True) if gated else w


def unpack_q4_tiles(packed: np.ndarray, n: int, gated: bool = False) -> np.ndarray:
    """MatMulQ4's packed tiles -> the W [K, N] fp32 they hold."""
    per_tile = _per_tile(packed)
    tiles, blocks, _ = per_tile.shape
    nib = per_tile[..., :256].reshape(tiles, blocks, 4, TILE, 4)  # [t, b, c, j, i]
    q = np.stack([nib & 0xF, nib >> 4], axis=3)  # [t, b, c, h, j, i]
    q = q.transpose(1, 2, 3, 5, 0, 4).reshape(blocks, TILE_BLOCK, tiles * TILE).astype(np.float32)
    scales, mins = (per_tile[..., off:off + 2 * TILE].copy().view(np.float16).astype(np.float32)
                    .transpose(1, 0, 2).reshape(blocks, 1, tiles * TILE) for off in (256, 256 + 2 * TILE))
    w = (q * scales + mins).reshape(blocks * TILE_BLOCK, tiles * TILE)[:, :n]
    return _gate_up_tiles(w, inverse=True) if gated else w


def dequantize(parts: dict[str, np.ndarray], spec: QuantSpec) -> np.ndarray:
    """What the graph computes with (MatMulNBits' parts; MatMulQ4's tiles: unpack_q4_tiles): -> W [K, N] fp32."""
    qweight, scales = parts[QWEIGHT], parts[SCALES]
    n, blocks, _ = qweight.shape
    w = _symmetric_value(_unpack(qweight, spec.bits), scales.reshape(n, blocks), spec.bits)
    if OFFSETS in parts:
        w = w + parts[OFFSETS].T[..., None]
    elif BLOCKSUMS in parts:
        kb = parts[BLOCKSUMS].shape[1]  # blocks along the layer's own K
        extra = w[:, kb:].reshape(n, -1)
        part = extra.shape[1] // (2 if spec.bits == 4 else 1)
        offsets = extra.reshape(n, -1, part).sum(axis=1)[:, :kb]  # coarse value + remainder
        w = w[:, :kb] + offsets[..., None]
    return w.reshape(n, -1).T.copy()


def bits_of(qweight: np.ndarray, block_size: int) -> int:
    """The bit width a qweight [N, blocks, blob] was packed with."""
    return int(qweight.shape[2] * 8 // block_size)


def quantize_weights(weights: dict[str, np.ndarray], names: list[str], spec: QuantSpec,
                     head: str | None = None, gated: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Replace each named [K, N] weight by its quantized parts at its precision (`spec.precision_of`; `head` at
    spec.head_bits unless the layout says otherwise); "fp32" layers and other weights stay. `gated`: the SwiGLU
    gate/up weights, packed for MatMulQ4's gated form when it takes them."""
    out = {k: v for k, v in weights.items() if k not in names and k != head}
    for name in names + ([head] if head else []):
        precision = spec.precision_of(name.removesuffix(".weight"), head=name == head)
        out.update(quantize_as(weights[name], name, precision, spec, name in gated))
    return out


def quantize_as(w: np.ndarray, name: str, precision: str, spec: QuantSpec, gated: bool = False) -> dict[str, np.ndarray]:
    """One weight [K, N] at one of PRECISIONS, as the arrays the graph reads (under `name` + their suffixes)."""
    if precision == "fp32":
        return {name: w}
    bits = int(precision.removeprefix("int").split("-")[0])
    if spec.kernel == "llmc" and precision != "int4-fp32act" and name != "lm_head.weight" and ternary_columns(w):
        # (the same values in fewer bytes, at any precision of llmc's tiles)
        return {name + (Q2TILES_GATED if gated else Q2TILES): pack_q2_tiles(w, gated, name)}
    if precision in ("int4", "int4-act16") and spec.q4_tiles(4):
        return {name + (Q4TILES_GATED if gated else Q4TILES): pack_q4_tiles(w, gated, name)}
    if precision in ("int8", "int8-act16") and spec.q8_tiles(8):
        return {name + (Q8TILES_GATED if gated else Q8TILES): pack_q8_tiles(w, gated, name)}
    # fp32 activations: the weights' exact scale + min grid (minmax) for 4 bits; as `scheme` otherwise
    scheme = "minmax" if precision == "int4-fp32act" else spec.scheme
    sub = QuantSpec(bits, spec.block_size, spec.head_bits, spec.accuracy_level, scheme, spec.kernel)
    return {name + suffix: array for suffix, array in quantize(w, sub, name).items()}


def compact_table(w: np.ndarray, name: str) -> dict[str, np.ndarray]:
    """An fp32 lookup table [V, H] in the smallest form that holds it exactly, as the arrays the graph's Gather reads
    (empty when none does): int8 with an fp16 scale per 32 values (GGUF Q8_0's form: q * d is exact in fp32) or
    bfloat16 (a bf16 checkpoint's own values); the Gather reads a quarter or half of the bytes, and a tied head's
    fp32 copy (its Gemm's, prepacked) is no longer held twice."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    v, h = w.shape
    rows = COLUMN_CHUNK  # (rows a slice at a time, as the tile packers take columns: their temporaries)
    if h % 32 == 0:
        q8, d = np.empty((v, h), np.int8), np.empty((v, h // 32), np.float16)
        for r in range(0, v, rows):
            blocks = w[r:r + rows].reshape(-1, h // 32, 32)
            d[r:r + rows] = (np.abs(blocks).max(-1) / 127.0).astype(np.float16)
            d32 = d[r:r + rows].astype(np.float32)
            q = np.rint(blocks / np.where(d32 > 0, d32, 1.0)[..., None])
            if not (np.all(np.isfinite(d32)) and np.all(np.abs(q) <= 127)
                    and np.array_equal((q * d32[..., None]).astype(np.float32), blocks)):
                break
            q8[r:r + rows] = q.reshape(-1, h)
        else:
            return {name + EMBED_Q8: q8, name + EMBED_Q8_SCALES: d}
        del q8, d
    bits = w.view(np.uint32)
    if not any(np.any(bits[r:r + rows] & 0xFFFF) for r in range(0, v, rows)):
        import ml_dtypes  # onnx's own dependency: the numpy dtype onnx stores as BFLOAT16

        return {name + EMBED_BF16: (bits >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)}
    return {}


def to_bf16_bits(w: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits (uint16), to nearest, ties to even (as the operator rounds x); NaN stays a (quiet) NaN."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), bits)


def pack_bf16_tiles(w_kn: np.ndarray, gated: bool = False) -> np.ndarray:
    """W [K, N] -> MatMulBF16's tiles [ceil(N / 16), K / 2, 32] bfloat16 (matmul_bf16.h): per tile of 16 columns and
    pair of rows p, each column's w[2p], w[2p + 1] side by side; columns past N are zeros. `gated`: W = [gate | up]
    of a SwiGLU MLP, its gate and up tiles alternating (as MatMulQ4's gated form)."""
    import ml_dtypes

    k, n = w_kn.shape
    if k % 2:
        raise ValueError(f"MatMulBF16 needs an even K, got {k}")
    if gated:
        if n % (2 * TILE):
            raise ValueError(f"MatMulBF16's gated form needs a gate/up width that is a multiple of {2 * TILE}, got {n}")
        w_kn = _gate_up_tiles(np.asarray(w_kn, np.float32))
    tiles = -(-n // 16)
    padded = np.zeros((k, tiles * 16), np.uint16)
    padded[:, :n] = to_bf16_bits(w_kn)
    packed = padded.reshape(k // 2, 2, tiles, 16).transpose(2, 0, 3, 1).reshape(tiles, k // 2, 32)
    return np.ascontiguousarray(packed).view(ml_dtypes.bfloat16)
