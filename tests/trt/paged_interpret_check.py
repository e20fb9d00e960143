"""Run the paged Triton attention kernel under TRITON_INTERPRET=1 (numpy on the CPU) against the paged reference.

Run as a script (a fresh process, so the interpreter flag is read before triton is): prints one JSON line per case
with the max error of the output (real query rows) and of the written pools.

Poison shows what the kernel must not read: block 0 is NaN and never allocated, and every table is zero-padded past
its row's blocks (a read of a padding entry lands there); with a sliding window, the blocks wholly before a row's
first tile's window are NaN too. A kernel that loaded any of them would turn its output into NaN (0 * NaN in
p @ v). The pools must come back equal to the reference's bit for bit, poison and spare blocks included.
"""

from __future__ import annotations

import numpy as np

CASES = [  # name, batch, heads, kv_heads, seq, dim, block_size, starts, counts, block_m, window, softcap, shared
    ("prefill", 2, 4, 2, 7, 16, 16, [0, 0], [7, 4], 64, 0, 0.0, 0),
    # a chunk after two cached blocks, one after 29 tokens crossing into a new block (with a pad); two tiles each
    ("chunk-after-cache", 2, 4, 1, 5, 16, 16, [32, 29], [5, 4], 16, 0, 0.0, 0),
    ("decode", 3, 6, 2, 1, 64, 16, [0, 17, 70], [1, 1, 1], 16, 0, 0.0, 0),
    # both rows' first block is one pool block (a cached prefix): they must read it alike
    ("shared-prefix", 2, 4, 2, 3, 16, 16, [20, 40], [3, 2], 16, 0, 0.0, 1),
    # one token after 150 (blocks 0..3, positions 0..63, poisoned), one after 40 (inside its window)
    ("decode-window", 2, 4, 2, 1, 16, 16, [150, 40], [1, 1], 16, 32, 0.0, 0),
    ("prefill-window-softcap", 2, 4, 2, 40, 16, 8, [0, 0], [40, 23], 64, 8, 1.0, 0),
    ("chunk-softcap-block64", 1, 4, 2, 4, 16, 64, [70], [4], 16, 0, 1.5, 0),
]


def skipped_positions(start: int, window: int) -> int:
    """Positions before the key block (BLOCK_N = 64) holding a row's first visible one: never to be loaded."""
    return 0 if window == 0 else max(0, start - window + 1) // 64 * 64


def layout(case: tuple, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """(block_table [B, max_blocks] int32, num_blocks): distinct shuffled blocks from 1 on, zero-padded, two spare."""
    _, batch, _, _, _, _, block_size, starts, counts, _, _, _, shared = case
    need = [-(-(starts[b] + counts[b]) // block_size) for b in range(batch)]
    num_blocks = 1 + sum(need) - shared + 2
    free = list(rng.permutation(np.arange(1, num_blocks)))
    table = np.zeros((batch, max(need) + 1), np.int32)
    for b in range(batch):
        for i in range(need[b]):
            table[b, i] = table[0, i] if b > 0 and i < shared else free.pop()
    return table, num_blocks


def run_case(case: tuple, dtype: str) -> dict[str, object]:
    import torch

    from llmc.engines.trt.plugin import launch_paged_attention, paged_attention_reference

    name, batch, heads, kv_heads, seq, dim, block_size, starts, counts, block_m, window, softcap, _ = case
    rng = np.random.default_rng(2)
    np_dtype = np.float16 if dtype == "float16" else np.float32
    table, num_blocks = layout(case, rng)
    q = rng.standard_normal((batch, heads, seq, dim)).astype(np_dtype)
    k_new, v_new = (rng.standard_normal((batch, kv_heads, seq, dim)).astype(np_dtype) for _ in range(2))
    pool_k, pool_v = (rng.standard_normal((num_blocks, kv_heads, block_size, dim)).astype(np_dtype) for _ in range(2))
    pool_k[0], pool_v[0] = np.nan, np.nan  # the padding entries' block
    pos = np.zeros((batch, seq), np.int64)
    for b in range(batch):
        pos[b, : counts[b]] = starts[b] + np.arange(counts[b])
    scale = dim ** -0.5
    want, want_k, want_v = paged_attention_reference(q, k_new, v_new, pool_k, pool_v, table, pos, scale,
                                                     window=window, softcap=softcap)  # (never reads block 0)
    skipped = [skipped_positions(starts[b], window) for b in range(batch)]
    for b, n in enumerate(skipped):
        for block in table[b, : n // block_size]:
            for a in (pool_k, pool_v, want_k, want_v):
                a[block] = np.nan
    t = [torch.from_numpy(a.copy()) for a in (q, k_new, v_new, pool_k, pool_v, table, pos)]
    got = launch_paged_attention(*t, scale, block_m, window=window, softcap=softcap).numpy()
    out_err = max(float(np.abs(got[b, :, :n].astype(np.float32) - want[b, :, :n].astype(np.float32)).max())
                  for b, n in enumerate(counts))
    pool_err = max(float(np.abs(np.nan_to_num(t[i].numpy().astype(np.float32), nan=1e9)
                                - np.nan_to_num(w.astype(np.float32), nan=1e9)).max())
                   for i, w in ((3, want_k), (4, want_v)))
    return {"case": name, "dtype": dtype, "out_err": out_err, "pool_err": pool_err,
            "scale": float(np.abs(want).max()), "skipped": max(skipped)}


if __name__ == "__main__":
    from interpreter_run import interpret_main  # this folder: the script's own, first on sys.path

    interpret_main(run_case, CASES)
