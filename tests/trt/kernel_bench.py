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


def _graph_ms(fn: Any) -> float | None:
    """One call's device time from CUDA-graph replays (no launch from Python in it: what TensorRT's C++ launch and
    the engine's captured decode steps pay), or None where the capture fails."""
    try:
        from triton.testing import do_bench_cudagraph

        return float(do_bench_cudagraph(fn, rep=20))
    except Exception:  # noqa: BLE001 - a timing aid: the launch times above stand without it
        return None


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
            "rel_err": err, "triton_ms": ours_ms, "sdpa_ms": _time_ms(sdpa),
            "triton_graph_ms": _graph_ms(lambda: launch_attention(q, k_new, v_new, cache_k, cache_v, pos, scale,
                                                                  block_m)),
            "sdpa_graph_ms": _graph_ms(sdpa)}


def to_pool(cache: Any, table: Any, block_size: int) -> Any:
    """Slot caches [B, Hkv, max_seq, D] as a pool [B * max_blocks, Hkv, block_size, D] (contiguous, as the paged
    kernel reads it) whose block table[b, i] holds row b's positions i * block_size onwards."""
    import torch

    batch, kv_heads, max_seq, dim = cache.shape
    blocks = cache.view(batch, kv_heads, max_seq // block_size, block_size, dim).transpose(1, 2).flatten(0, 1)
    # (empty_like would copy a single row's transposed strides: the pool would not be laid out as the kernel reads)
    pool = torch.empty(blocks.shape, dtype=blocks.dtype, device=blocks.device)
    return pool.index_copy_(0, table.flatten().long(), blocks)


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

    pool_k, pool_v = to_pool(cache_k, table, block_size), to_pool(cache_v, table, block_size)
    block_m, scale = BLOCK_M["prefill" if kind == "prefill" else "decode"], dim ** -0.5
    ref = launch_attention(q, k_new, v_new, cache_k, cache_v, pos, scale, block_m)
    out = launch_paged_attention(q, k_new, v_new, pool_k, pool_v, table, pos, scale, block_m)
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    return {"kind": kind, "batch": batch, "heads": f"{heads}/{kv_heads}", "dim": dim, "length": length,
            "rel_err": err, "kv_equal": bool(torch.equal(to_pool(cache_k, table, block_size), pool_k)
                                             and torch.equal(to_pool(cache_v, table, block_size), pool_v)),
            "slot_ms": _time_ms(lambda: launch_attention(q, k_new, v_new, cache_k, cache_v, pos, scale, block_m)),
            "paged_ms": _time_ms(lambda: launch_paged_attention(q, k_new, v_new, pool_k, pool_v, table, pos, scale,
                                                                block_m))}
