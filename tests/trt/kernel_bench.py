"""The Triton attention kernel against torch's scaled_dot_product_attention in fp16 on a GPU: error and speed.

Used by tests/trt/test_gpu_kernels.py (asserts) and scripts/gpu_check.sh (prints the rows of its table).
"""

from __future__ import annotations

from typing import Any

# (kind, batch, heads, kv_heads, head_dim, length): prefill of `length` tokens, or decode after `length - 1`.
CASES = [
    ("prefill", 1, 9, 3, 64, 17), ("prefill", 4, 9, 3, 64, 128), ("prefill", 1, 9, 3, 64, 512),
    ("prefill", 2, 32, 8, 128, 1000),
    ("decode", 1, 9, 3, 64, 1), ("decode", 1, 9, 3, 64, 513), ("decode", 64, 9, 3, 64, 640),
    ("decode", 8, 32, 8, 128, 2048),
]
MAX_SEQ = 2048


def _time_ms(fn: Any, repeat: int = 50) -> float:
    import torch

    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end) / repeat)


def compare(kind: str, batch: int, heads: int, kv_heads: int, dim: int, length: int) -> dict[str, Any]:
    """Relative max error of our kernel vs SDPA (GQA, causal for prefill) and both kernels' times."""
    import torch
    import torch.nn.functional as F

    from llmc.engines.trt.lower import BLOCK_M
    from llmc.engines.trt.plugin import launch_attention

    torch.manual_seed(0)
    dev, f16 = "cuda", torch.float16
    seq = length if kind == "prefill" else 1
    start = 0 if kind == "prefill" else length - 1
    q = torch.randn(batch, heads, seq, dim, device=dev, dtype=f16)
    k_new, v_new = (torch.randn(batch, kv_heads, seq, dim, device=dev, dtype=f16) for _ in range(2))
    cache_k, cache_v = (torch.randn(batch, kv_heads, MAX_SEQ, dim, device=dev, dtype=f16) for _ in range(2))
    pos = (start + torch.arange(seq, device=dev)).expand(batch, seq).contiguous()
    scale = dim ** -0.5
    block_m = BLOCK_M["prefill" if kind == "prefill" else "decode"]
    out = launch_attention(q, k_new, v_new, cache_k, cache_v, pos, scale, block_m)
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]  # now holds the new K/V at start..start+seq-1
    assert torch.equal(k[:, :, start:], k_new) and torch.equal(v[:, :, start:], v_new)

    def sdpa() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=kind == "prefill", scale=scale, enable_gqa=True)

    ref = sdpa()
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    ours_ms = _time_ms(lambda: launch_attention(q, k_new, v_new, cache_k, cache_v, pos, scale, block_m))
    return {"kind": kind, "batch": batch, "heads": f"{heads}/{kv_heads}", "dim": dim, "length": length,
            "rel_err": err, "triton_ms": ours_ms, "sdpa_ms": _time_ms(sdpa)}


def compare_paged(kind: str, batch: int, heads: int, kv_heads: int, dim: int, length: int,
                  block_size: int = 16) -> dict[str, Any]:
    """The paged kernel against the slot kernel on the same caches (the slots' blocks shuffled into one pool):
    relative max error of the outputs, whether the written K/V read back equal, and both kernels' times."""
    import torch

    from llmc.engines.trt.lower import BLOCK_M
    from llmc.engines.trt.plugin import launch_attention, launch_paged_attention

    torch.manual_seed(0)
    dev, f16 = "cuda", torch.float16
    seq = length if kind == "prefill" else 1
    q = torch.randn(batch, heads, seq, dim, device=dev, dtype=f16)
    k_new, v_new = (torch.randn(batch, kv_heads, seq, dim, device=dev, dtype=f16) for _ in range(2))
    cache_k, cache_v = (torch.randn(batch, kv_heads, MAX_SEQ, dim, device=dev, dtype=f16) for _ in range(2))
    pos = (length - seq + torch.arange(seq, device=dev)).expand(batch, seq).contiguous()
    max_blocks = MAX_SEQ // block_size
    table = torch.randperm(batch * max_blocks, device=dev).to(torch.int32).view(batch, max_blocks)

    def pool(cache: Any) -> Any:  # [B, Hkv, MAX_SEQ, D] -> [num_blocks, Hkv, block_size, D] through the table
        blocks = cache.view(batch, kv_heads, max_blocks, block_size, dim).transpose(1, 2).flatten(0, 1)
        return torch.empty_like(blocks).index_copy_(0, table.flatten().long(), blocks)

    pool_k, pool_v = pool(cache_k), pool(cache_v)
    block_m, scale = BLOCK_M["prefill" if kind == "prefill" else "decode"], dim ** -0.5
    ref = launch_attention(q, k_new, v_new, cache_k, cache_v, pos, scale, block_m)
    out = launch_paged_attention(q, k_new, v_new, pool_k, pool_v, table, pos, scale, block_m)
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    return {"kind": kind, "batch": batch, "heads": f"{heads}/{kv_heads}", "dim": dim, "length": length,
            "rel_err": err, "kv_equal": bool(torch.equal(pool(cache_k), pool_k) and torch.equal(pool(cache_v), pool_v)),
            "slot_ms": _time_ms(lambda: launch_attention(q, k_new, v_new, cache_k, cache_v, pos, scale, block_m)),
            "paged_ms": _time_ms(lambda: launch_paged_attention(q, k_new, v_new, pool_k, pool_v, table, pos, scale,
                                                                block_m))}
