"""The Triton kernels of llmc's TensorRT attention plugins (plugin.py says what they compute and how they are
launched): flash-attention forward over the slot cache (`llmc_attention_fwd`) and over a paged cache
(`llmc_paged_attention_fwd`), sharing one key block's online-softmax step. Imported only where Triton is installed
(plugin.attention_kernel / paged_attention_kernel); its interpreter (TRITON_INTERPRET=1) runs them on the CPU.
"""

import triton
import triton.language as tl


@triton.jit
def _online_softmax_block(q, k, v, t, pos, m_i, l_i, acc, SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
                          WINDOW: tl.constexpr):
    """Fold one key block into each query row's running max m_i, sum l_i and accumulator acc: scores q.k (fp32
    accumulate) scaled, or soft-capped to c * tanh(s / c) with SOFTCAP c > 0 (tanh via exp(-2|x|): no overflow,
    CUDA and interpreter alike), visible where key t <= the query's position (and t > position - WINDOW), in the
    log2 domain (exp2 instead of exp)."""
    log2e = 1.4426950408889634
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
    if SOFTCAP > 0:
        x = qk * (SCALE / SOFTCAP)
        e = tl.exp2(tl.abs(x) * (-2.0 * log2e))
        th = (1.0 - e) / (1.0 + e)
        qk = tl.where(x < 0, -th, th) * (SOFTCAP * log2e)
    else:
        qk = qk * (SCALE * log2e)
    visible = t[None, :] <= pos[:, None]
    if WINDOW > 0:
        visible = visible & (t[None, :] > pos[:, None] - WINDOW)
    qk = tl.where(visible, qk, -1.0e30)
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _query_tile(Q, POS, S, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """This program's tile: BLOCK_M query rows, (token s, group head g) pairs of one KV head kvh of batch row b,
    their queries q [BLOCK_M, BLOCK_D] and positions, and where the row's new tokens start."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    kvh = pid_bh % HKV
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S * G
    s = rows // G
    h = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_rows = ((b * HKV * G + h) * S + s)[:, None] * D + d[None, :]  # [BLOCK_M, BLOCK_D]
    q = tl.load(Q + q_rows, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = tl.load(POS + b * S + s, mask=row_ok, other=-1)  # [BLOCK_M] each query's position
    start = tl.load(POS + b * S)  # where this row's new tokens are written
    return b, kvh, rows, row_ok, s, d, d_ok, q_rows, q, pos, start


@triton.jit
def _key_range(pos, real, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """[lo, hi): the key positions the tile's rows may see, lo at a block of BLOCK_N.

    With a window, lo is the block of the earliest position a real row sees. A right-padded pad (s > 0 at position
    0) is left out: its output is garbage by contract, and with it a tile holding a row's last tokens and its pads
    would start at block 0 (there the pads' rows, seeing nothing, average the block's values: finite). Each real row
    sees itself, so no real row is left without a key; a tile of pads only falls back to hi - 1 = 0 (block 0, the
    reference's answer), never to an empty loop (0 / 0: NaN pads would write NaN K/V that 0 * NaN spreads to real
    rows)."""
    hi = (tl.max(pos, axis=0) + 1).to(tl.int32)
    lo = 0
    if WINDOW > 0:
        first_pos = tl.min(tl.where(real, pos, hi - 1), axis=0)
        lo = (tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N).to(tl.int32)
    return lo, hi


@triton.jit
def _row_state(pos, row_ok, s, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               WINDOW: tl.constexpr):
    """The tile's real rows (right-padded pads, s > 0 at position 0, are neither written nor kept), the online
    softmax's starting state (max, sum, accumulator) and the key range [lo, hi) its loop covers."""
    real = row_ok & ((s == 0) | (pos > 0))
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(pos, real, BLOCK_N, WINDOW)
    return real, m_i, l_i, acc, lo, hi


@triton.jit
def _key_block(KN, VN, KC, VC, new_at, old_at, new_mask, old_mask):
    """A key block's keys and values [BLOCK_N, BLOCK_D]: the run's new tokens from KN / VN, the others from the
    cache KC / VC (so no program reads what another writes)."""
    k = tl.where(new_mask, tl.load(KN + new_at, mask=new_mask, other=0.0), tl.load(KC + old_at, mask=old_mask, other=0.0))
    v = tl.where(new_mask, tl.load(VN + new_at, mask=new_mask, other=0.0), tl.load(VC + old_at, mask=old_mask, other=0.0))
    return k, v


@triton.jit
def llmc_attention_fwd(Q, KN, VN, KC, VC, POS, S, MAX_SEQ, OUT, KC_OUT, VC_OUT,
                       HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                       WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b, kvh, rows, row_ok, s, d, d_ok, q_rows, q, pos, start = _query_tile(Q, POS, S, HKV, G, D, BLOCK_M, BLOCK_D)
    kv_head = b * HKV + kvh
    _real, m_i, l_i, acc, lo, hi = _row_state(pos, row_ok, s, BLOCK_M, BLOCK_N, BLOCK_D, WINDOW)
    for first in range(lo, hi, BLOCK_N):
        t = first + tl.arange(0, BLOCK_N)  # key positions
        rel = t - start
        is_new = (rel >= 0) & (rel < S)
        new_mask = is_new[:, None] & d_ok[None, :]
        old_mask = (~is_new & (t < MAX_SEQ))[:, None] & d_ok[None, :]
        new_at = (kv_head * S + rel)[:, None] * D + d[None, :]
        old_at = (kv_head * MAX_SEQ + t)[:, None] * D + d[None, :]
        k, v = _key_block(KN, VN, KC, VC, new_at, old_at, new_mask, old_mask)
        m_i, l_i, acc = _online_softmax_block(q, k, v, t, pos, m_i, l_i, acc, SCALE, SOFTCAP, WINDOW)
    out = acc / l_i[:, None]
    tl.store(OUT + q_rows, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    writes = (row_ok & (rows % G == 0) & (start + s < MAX_SEQ))[:, None] & d_ok[None, :]
    src = (kv_head * S + s)[:, None] * D + d[None, :]
    dst = (kv_head * MAX_SEQ + start + s)[:, None] * D + d[None, :]
    tl.store(KC_OUT + dst, tl.load(KN + src, mask=writes, other=0.0), mask=writes)
    tl.store(VC_OUT + dst, tl.load(VN + src, mask=writes, other=0.0), mask=writes)


@triton.jit
def llmc_paged_attention_fwd(Q, KN, VN, KP, VP, BT, POS, S, MAX_BLOCKS, OUT, KP_OUT, VP_OUT,
                             HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                             WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    b, kvh, rows, row_ok, s, d, d_ok, q_rows, q, pos, start = _query_tile(Q, POS, S, HKV, G, D, BLOCK_M, BLOCK_D)
    kv_head = b * HKV + kvh
    table = BT + b * MAX_BLOCKS  # this row's block table
    capacity = MAX_BLOCKS * BLOCK_SIZE
    real, m_i, l_i, acc, lo, hi = _row_state(pos, row_ok, s, BLOCK_M, BLOCK_N, BLOCK_D, WINDOW)
    for first in range(lo, hi, BLOCK_N):
        t = first + tl.arange(0, BLOCK_N)  # key positions
        rel = t - start
        is_new = (rel >= 0) & (rel < S)
        is_old = ~is_new & (t < hi) & (t < capacity)
        block = tl.load(table + t // BLOCK_SIZE, mask=is_old, other=0).to(tl.int64)
        new_mask = is_new[:, None] & d_ok[None, :]
        old_mask = is_old[:, None] & d_ok[None, :]
        new_at = (kv_head * S + rel)[:, None] * D + d[None, :]
        old_at = ((block * HKV + kvh) * BLOCK_SIZE + t % BLOCK_SIZE)[:, None] * D + d[None, :]
        k, v = _key_block(KN, VN, KP, VP, new_at, old_at, new_mask, old_mask)
        m_i, l_i, acc = _online_softmax_block(q, k, v, t, pos, m_i, l_i, acc, SCALE, SOFTCAP, WINDOW)
    out = acc / l_i[:, None]
    tl.store(OUT + q_rows, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    at = start + s  # each real new token's position, its block and offset
    write = real & (rows % G == 0) & (at < capacity)
    w_block = tl.load(table + at // BLOCK_SIZE, mask=write, other=0).to(tl.int64)
    writes = write[:, None] & d_ok[None, :]
    src = (kv_head * S + s)[:, None] * D + d[None, :]
    dst = ((w_block * HKV + kvh) * BLOCK_SIZE + at % BLOCK_SIZE)[:, None] * D + d[None, :]
    tl.store(KP_OUT + dst, tl.load(KN + src, mask=writes, other=0.0), mask=writes)
    tl.store(VP_OUT + dst, tl.load(VN + src, mask=writes, other=0.0), mask=writes)
