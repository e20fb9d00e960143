"""Run the Triton attention kernel under TRITON_INTERPRET=1 (numpy on the CPU) against the numpy reference.

Run as a script (a fresh process, so the interpreter flag is read before triton is): prints one JSON line per case
with the max error of the output (real query rows) and of the written caches.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

CASES = [  # name, batch, heads, kv_heads, seq, max_seq, dim, starts, counts, block_m
    ("prefill", 3, 4, 2, 7, 80, 16, [0, 0, 0], [7, 3, 5], 64),
    ("prefill-long", 2, 6, 2, 70, 80, 64, [0, 0], [70, 41], 64),
    ("decode", 3, 9, 3, 1, 80, 64, [0, 66, 79], [1, 1, 1], 16),
    ("chunk", 2, 4, 1, 3, 80, 16, [62, 5], [3, 2], 16),
]


def run_case(case: tuple, dtype: str) -> dict[str, object]:
    import torch

    from llmc.engines.trt_plugin import attention_reference, launch_attention

    name, batch, heads, kv_heads, seq, max_seq, dim, starts, counts, block_m = case
    rng = np.random.default_rng(1)
    np_dtype = np.float16 if dtype == "float16" else np.float32
    q = rng.standard_normal((batch, heads, seq, dim)).astype(np_dtype)
    k_new, v_new = (rng.standard_normal((batch, kv_heads, seq, dim)).astype(np_dtype) for _ in range(2))
    past_k, past_v = (rng.standard_normal((batch, kv_heads, max_seq, dim)).astype(np_dtype) for _ in range(2))
    pos = np.zeros((batch, seq), np.int64)
    for b in range(batch):
        pos[b, : counts[b]] = starts[b] + np.arange(counts[b])
    scale = dim ** -0.5
    want, want_k, want_v = attention_reference(q, k_new, v_new, past_k, past_v, pos, scale)
    t = [torch.from_numpy(a.copy()) for a in (q, k_new, v_new, past_k, past_v, pos)]
    got = launch_attention(t[0], t[1], t[2], t[3], t[4], t[5], scale, block_m).numpy()
    out_err = max(float(np.abs(got[b, :, :n].astype(np.float32) - want[b, :, :n].astype(np.float32)).max())
                  for b, n in enumerate(counts))
    cache_err = max(float(np.abs(t[3].numpy().astype(np.float32) - want_k.astype(np.float32)).max()),
                    float(np.abs(t[4].numpy().astype(np.float32) - want_v.astype(np.float32)).max()))
    return {"case": name, "dtype": dtype, "out_err": out_err, "cache_err": cache_err,
            "scale": float(np.abs(want).max())}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for dtype in sys.argv[1:] or ["float32", "float16"]:
        for case in CASES:
            print(json.dumps(run_case(case, dtype)), flush=True)


if __name__ == "__main__":
    main()
