"""Run the Triton attention kernel under TRITON_INTERPRET=1 (numpy on the CPU) against the numpy reference.

Run as a script (a fresh process, so the interpreter flag is read before triton is): prints one JSON line per case
with the max error of the output (real query rows) and of the written caches.

With a sliding window, the cache blocks a row's tile must skip (wholly before its window) are NaN in the kernel's
copy: a kernel that loaded them would turn its output into NaN (0 * NaN in p @ v), so a finite error shows they
were never read.
"""

from __future__ import annotations

import numpy as np

CASES = [  # name, batch, heads, kv_heads, seq, max_seq, dim, starts, counts, block_m, window, softcap
    ("prefill", 3, 4, 2, 7, 80, 16, [0, 0, 0], [7, 3, 5], 64, 0, 0.0),
    ("prefill-long", 2, 6, 2, 70, 80, 64, [0, 0], [70, 41], 64, 0, 0.0),
    ("decode", 3, 9, 3, 1, 80, 64, [0, 66, 79], [1, 1, 1], 16, 0, 0.0),
    ("chunk", 2, 4, 1, 3, 80, 16, [62, 5], [3, 2], 16, 0, 0.0),
    # prompt rows under a window of 8 (the short row's last tile is pads only); then a chunked prompt after 160
    # cached tokens: its first tile skips block 0 (its rows see 97..), the second blocks 0 and 64 (129..)
    ("prefill-window", 2, 4, 2, 40, 80, 16, [0, 0], [40, 23], 64, 8, 0.0),
    ("prefill-window-past", 1, 4, 2, 40, 200, 16, [160], [40], 64, 64, 0.0),
    # one token after a long past (200: blocks 0 and 64 skipped), a short one (63: none), one inside the window
    ("decode-window", 3, 4, 2, 1, 256, 16, [200, 63, 5], [1, 1, 1], 16, 64, 0.0),
    ("prefill-softcap", 2, 4, 2, 7, 80, 16, [0, 0], [7, 4], 64, 0, 1.0),
    # Gemma 2's pair: window and softcap, a 3-token chunk after 200 and a 2-token one (plus a pad) after 130
    ("chunk-window-softcap", 2, 4, 1, 3, 256, 16, [200, 130], [3, 2], 16, 64, 1.5),
]


def skipped_blocks(start: int, window: int) -> int:
    """Positions before the block holding a row's first visible one: the kernel must never load them."""
    block = 64  # llmc.engines.trt.plugin.BLOCK_N, checked in main()
    return 0 if window == 0 else max(0, start - window + 1) // block * block


def run_case(case: tuple, dtype: str) -> dict[str, object]:
    import torch

    from llmc.engines.trt.plugin import attention_reference, launch_attention

    name, batch, heads, kv_heads, seq, max_seq, dim, starts, counts, block_m, window, softcap = case
    rng = np.random.default_rng(1)
    np_dtype = np.float16 if dtype == "float16" else np.float32
    q = rng.standard_normal((batch, heads, seq, dim)).astype(np_dtype)
    k_new, v_new = (rng.standard_normal((batch, kv_heads, seq, dim)).astype(np_dtype) for _ in range(2))
    past_k, past_v = (rng.standard_normal((batch, kv_heads, max_seq, dim)).astype(np_dtype) for _ in range(2))
    pos = np.zeros((batch, seq), np.int64)
    for b in range(batch):
        pos[b, : counts[b]] = starts[b] + np.arange(counts[b])
    scale = dim ** -0.5
    want, want_k, want_v = attention_reference(q, k_new, v_new, past_k, past_v, pos, scale, window=window,
                                               softcap=softcap)
    poisoned = [skipped_blocks(starts[b], window) for b in range(batch)]
    for b, n in enumerate(poisoned):
        for a in (past_k, past_v, want_k, want_v):
            a[b, :, :n] = np.nan
    t = [torch.from_numpy(a.copy()) for a in (q, k_new, v_new, past_k, past_v, pos)]
    got = launch_attention(t[0], t[1], t[2], t[3], t[4], t[5], scale, block_m, window=window,
                           softcap=softcap).numpy()
    out_err = max(float(np.abs(got[b, :, :n].astype(np.float32) - want[b, :, :n].astype(np.float32)).max())
                  for b, n in enumerate(counts))
    cache_err = max(float(np.abs(np.nan_to_num(t[i].numpy().astype(np.float32), nan=1e9)
                                 - np.nan_to_num(w.astype(np.float32), nan=1e9)).max())
                    for i, w in ((3, want_k), (4, want_v)))  # the poison stays where it was
    return {"case": name, "dtype": dtype, "out_err": out_err, "cache_err": cache_err,
            "scale": float(np.abs(want).max()), "skipped": max(poisoned),
            "finite": bool(np.isfinite(got).all())}  # pad rows too: NaN there would reach the cache


if __name__ == "__main__":
    from interpreter_run import interpret_main  # this folder: the script's own, first on sys.path

    interpret_main(run_case, CASES)
