"""The `llmc::attention` op three ways: a numpy reference, that reference as an ONNX Runtime custom op (CPU checks of
the lowered graphs), and the TensorRT plugin whose ahead-of-time compiled Triton kernel runs inside the engine.

Semantics (those of the TensorScatter x2 + Slice x2 + Attention subgraph it replaces, see trt_lower.py):
  q [B, H, S, D], k_new / v_new [B, Hkv, S, D], past_key / past_value [B, Hkv, max_seq, D], position_ids [B, S].
  Row b writes its S new K/V at cache positions position_ids[b, 0] + 0..S-1 (right-padded rows: pads land past the
  row's length, where its next tokens overwrite them). Query s of row b sees key t iff t <= position_ids[b, s]
  (pads carry position 0) and, with a sliding window W > 0, t > position_ids[b, s] - W (the last W positions, as
  transformers' sliding-window mask). Scores are q.k * scale, then, with softcap c > 0, c * tanh(score / c) (Gemma 2).
  Head h reads KV head h // (H // Hkv). Outputs: attn [B, H, S, D] and the updated caches.

`llmc::paged_attention` is the same attention over a paged cache: past_key / past_value become pools
  key_pool / value_pool [num_blocks, Hkv, block_size, D] and a block_table [B, max_blocks] int32 comes before
  position_ids; row b's position t sits in block block_table[b, t // block_size] at offset t % block_size (rows may
  share blocks: a cached prefix). Only a row's real new tokens are written (s = 0 and every s with a position > 0;
  right-padded pads may have no block to land in), and only blocks holding positions a row reads are read.

No `from __future__ import annotations` here: tensorrt.plugin reads the decorated functions' annotations as types.
Triton, torch, tensorrt and onnxruntime-extensions are imported only inside the functions that need them.
"""

import ctypes
import functools
import inspect
import math
import re
from typing import Any

import numpy as np

from llmc.engines.trt.lower import PAGED_PLUGIN_ID, PLUGIN_ID

# Tile sizes: key block, and compile options shared by both configurations (decode: BLOCK_M 16, prefill: 64).
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2


def attention_reference(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, past_key: np.ndarray,
                        past_value: np.ndarray, position_ids: np.ndarray, scale: float, window: int = 0,
                        softcap: float = 0.0, sinks: np.ndarray | None = None,
                        chunk: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(attn, present_key, present_value); present_* are updated copies of past_* (the op writes in place).
    `window` W > 0: each query sees its last W positions only; `softcap` c > 0: scores become c * tanh(s / c);
    `sinks` [heads]: each head's softmax takes one more logit, whose value is 0 (GPT-OSS); `chunk` C > 0: a query
    at p sees the keys of its own block, floor(p / C) * C <= t <= p (Llama 4; llmc's CachedAttention only)."""
    batch, heads, seq, dim = q.shape
    kv_heads, max_seq = past_key.shape[1], past_key.shape[2]
    present_k, present_v = past_key.copy(), past_value.copy()
    start = position_ids[:, 0].astype(np.int64)
    for b in range(batch):
        n = max(0, min(seq, max_seq - int(start[b])))  # the kernel skips writes past the buffer too
        present_k[b, :, start[b]:start[b] + n] = k_new[b, :, :n]
        present_v[b, :, start[b]:start[b] + n] = v_new[b, :, :n]
    total = int(position_ids.max()) + 1
    assert total <= max_seq, f"position {total - 1} is outside the {max_seq}-position cache"
    k = present_k[:, :, :total].astype(np.float32)  # [B, Hkv, T, D]
    v = present_v[:, :, :total].astype(np.float32)
    q5 = q.astype(np.float32).reshape(batch, kv_heads, heads // kv_heads, seq, dim)  # [B, Hkv, G, S, D]
    scores = np.einsum("bkgsd,bktd->bkgst", q5, k) * np.float32(scale)
    if softcap > 0:
        scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
    keys = np.arange(total)[None, None, :]
    visible = keys <= position_ids[:, :, None]  # [B, S, T]
    if window > 0:
        visible &= keys > position_ids[:, :, None] - window
    if chunk > 0:
        visible &= keys // chunk == position_ids[:, :, None] // chunk
    scores = np.where(visible[:, None, None], scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores - top)
    total = probs.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sinks.reshape(1, kv_heads, heads // kv_heads, 1, 1) - top)
    probs /= total
    out = np.einsum("bkgst,bktd->bkgsd", probs, v).reshape(batch, heads, seq, dim)
    return out.astype(q.dtype), present_k, present_v


def real_tokens(position_ids: np.ndarray) -> np.ndarray:
    """[B] how many of each row's S tokens are real: s = 0 always, s > 0 iff its position is > 0 (pads carry 0)."""
    return 1 + (position_ids[:, 1:] > 0).sum(axis=1).astype(np.int64)


def paged_attention_reference(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, key_pool: np.ndarray,
                              value_pool: np.ndarray, block_table: np.ndarray, position_ids: np.ndarray,
                              scale: float, window: int = 0,
                              softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(attn, present_key_pool, present_value_pool): `attention_reference` over pools [num_blocks, Hkv, block_size, D]
    read and written through block_table [B, max_blocks] (updated copies of the pools, as attention_reference's).

    Each row's blocks holding positions 0..max(position) are gathered into a slot view (later table entries, which
    may be padding, are not read: zeros), the slot reference runs on the views, and the row's real new tokens
    (`real_tokens`; writes past max_blocks * block_size are skipped, as past max_seq) are scattered back into their
    blocks: nothing else in the pools changes, and a block two rows share is read the same by both.
    """
    batch, (kv_heads, block_size, dim), max_blocks = q.shape[0], key_pool.shape[1:], block_table.shape[1]
    views = [np.zeros((batch, kv_heads, max_blocks * block_size, dim), key_pool.dtype) for _ in range(2)]
    for b in range(batch):
        for i in range(min(max_blocks, -(-(int(position_ids[b].max()) + 1) // block_size))):
            at = slice(i * block_size, (i + 1) * block_size)
            views[0][b, :, at], views[1][b, :, at] = key_pool[block_table[b, i]], value_pool[block_table[b, i]]
    out, present_k, present_v = attention_reference(q, k_new, v_new, views[0], views[1], position_ids, scale,
                                                    window=window, softcap=softcap)
    pool_k, pool_v = key_pool.copy(), value_pool.copy()
    for b, n in enumerate(real_tokens(position_ids)):
        for t in range(int(position_ids[b, 0]), min(int(position_ids[b, 0]) + int(n), max_blocks * block_size)):
            block, off = block_table[b, t // block_size], t % block_size
            pool_k[block, :, off], pool_v[block, :, off] = present_k[b, :, t], present_v[b, :, t]
    return out, pool_k, pool_v


_ORT_REGISTERED = False


def register_ort_reference() -> str:
    """Register the reference as ONNX Runtime custom op llmc::attention (float32 graphs).

    Returns the library path to pass to SessionOptions.register_custom_ops_library. Needs onnxruntime-extensions.
    The node's attributes scale (float), window (int) and softcap (float) are all required (as trt_lower writes
    them): onnxruntime-extensions refuses a session whose node lacks a declared attribute.
    """
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    global _ORT_REGISTERED
    if not _ORT_REGISTERED:
        f32, i64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64

        @onnx_op(op_type=PLUGIN_ID, inputs=[f32, f32, f32, f32, f32, i64], outputs=[f32, f32, f32],
                 attrs={"scale": PyCustomOpDef.dt_float, "window": PyCustomOpDef.dt_int64,
                        "softcap": PyCustomOpDef.dt_float})
        def _attention(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, past_key: np.ndarray,
                       past_value: np.ndarray, position_ids: np.ndarray, scale: float, window: int = 0,
                       softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return attention_reference(q, k_new, v_new, past_key, past_value, position_ids, scale,
                                       window=int(window), softcap=float(softcap))

        _ORT_REGISTERED = True
    return str(get_library_path())


@functools.cache
def attention_kernel() -> Any:
    """The Triton kernel (flash-attention forward with online softmax over key blocks), built on first use.

    One program per (tile of BLOCK_M query rows, batch row x KV head). A tile's rows are (token s, group head g)
    pairs of one KV head, so each K/V block is loaded once for the G query heads that share it (grouped heads):
    with S = 1 (decode) one 16-row tile holds all G heads, with a prompt it covers BLOCK_M / G tokens. Keys at the
    row's new positions are read from k_new / v_new, all others from the cache, so no program reads what another
    writes; the rows of the group's first head then store the new K/V into the cache (KC_OUT aliases KC).
    WINDOW W > 0 (constexpr): a tile's key loop starts at the block holding the earliest position any of its real
    rows sees, max(0, min pos - W + 1) (earlier blocks are never loaded), and each row masks t <= pos - W.
    SOFTCAP c > 0 (constexpr): natural-scale scores s become c * tanh(s / c) before the online softmax, which then
    runs in the log2 domain (exp2).
    """
    from llmc.engines.trt.triton_attention import llmc_attention_fwd

    return llmc_attention_fwd


def kernel_constants(num_heads: int, kv_num_heads: int, head_dim: int, scale: float, block_m: int,
                     window: int = 0, softcap: float = 0.0) -> dict[str, int | float]:
    """The kernel's constexprs (in its parameter order). window 0 / softcap 0.0: off."""
    if window < 0 or softcap < 0:
        raise ValueError(f"window ({window}) and softcap ({softcap}) must be >= 0 (0: off)")
    return {"HKV": kv_num_heads, "G": num_heads // kv_num_heads, "D": head_dim, "SCALE": float(scale),
            "WINDOW": int(window), "SOFTCAP": float(softcap),
            "BLOCK_M": block_m, "BLOCK_N": BLOCK_N, "BLOCK_D": max(16, 1 << (head_dim - 1).bit_length())}


def launch_attention(q: Any, k_new: Any, v_new: Any, past_key: Any, past_value: Any, position_ids: Any,
                     scale: float, block_m: int, window: int = 0, softcap: float = 0.0) -> Any:
    """Run the kernel on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); writes the caches in place."""
    import torch

    batch, heads, seq, dim = q.shape
    kv_heads, max_seq = past_key.shape[1], past_key.shape[2]
    out = torch.empty_like(q)
    consts = kernel_constants(heads, kv_heads, dim, scale, block_m, window, softcap)
    grid = (math.ceil(seq * consts["G"] / block_m), batch * kv_heads)
    attention_kernel()[grid](q, k_new, v_new, past_key, past_value, position_ids, seq, max_seq, out, past_key,
                             past_value, **consts, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


SIGNATURE = ("Q", "KN", "VN", "KC", "VC", "POS", "S", "MAX_SEQ", "OUT", "KC_OUT", "VC_OUT")


def compile_attention(dtype: str, num_heads: int, kv_num_heads: int, head_dim: int, scale: float, block_m: int,
                      target: Any = None, *, window: int = 0, softcap: float = 0.0) -> Any:
    """Compile the kernel ahead of time (PTX) for `target` (default: this machine's GPU)."""
    consts = kernel_constants(num_heads, kv_num_heads, head_dim, scale, block_m, window, softcap)
    special = {"S": "i32", "MAX_SEQ": "i32", "POS": "*i64"}
    return _compile(attention_kernel(), "attention", SIGNATURE, special, dtype, consts, target)


def ptx_isa(ptx: str) -> int:
    """The PTX ISA a module declares (`.version 9.4` -> 94)."""
    found = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", ptx, re.M)
    if found is None:
        raise ValueError("the PTX declares no .version")
    return int(found.group(1)) * 10 + int(found.group(2))


def cuda_ptx_isa(cuda_version: int) -> int:
    """The newest PTX ISA a CUDA release compiles, from its version number as cuDriverGetVersion gives it
    (12080 -> 87, 13000 -> 90): 11.x -> 7.x, 12.0-12.5 -> 8.0-8.5, 12.6 -> 8.5, 12.8 -> 8.7, 12.9 -> 8.8, 13.x -> 9.x."""
    major, minor = cuda_version // 1000, cuda_version % 1000 // 10
    if major >= 13:
        return 90 + (major - 13) * 10 + minor
    if major == 12:
        return 80 + minor - (minor >= 6)
    if major == 11:
        return 70 + minor
    raise ValueError(f"CUDA {major}.{minor} is older than 11.0, the oldest the plugin's PTX is written for")


def driver_ptx_isa() -> int | None:
    """The newest PTX ISA this machine's CUDA driver compiles, or None where there is no driver.

    TensorRT takes the plugin's kernel as PTX. Triton declares the ISA of the ptxas it ships (9.4 from Triton 3.9's
    CUDA 13.4), which an older driver's compiler refuses (CUDA_ERROR_UNSUPPORTED_PTX_VERSION, seen with a CUDA 13.0
    driver): `_compile` then writes the kernel again for the driver's ISA."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return cuda_ptx_isa(version.value)


def _compile(kernel: Any, what: str, parameters: tuple[str, ...], special: dict[str, str], dtype: str,
             consts: dict[str, int | float], target: Any) -> Any:
    """triton.compile of `kernel` with every parameter a pointer to `dtype` but the `special` ones, and `consts`
    as its constexprs, its PTX no newer than this machine's driver compiles (`driver_ptx_isa`); a kernel that would
    need scratch memory TensorRT's AOT plugins cannot give is refused."""
    import triton

    ty = {"float16": "fp16", "float32": "fp32"}[dtype]
    signature = {**{n: special.get(n, f"*{ty}") for n in parameters}, **{name: "constexpr" for name in consts}}
    params = inspect.signature(triton.compiler.ASTSource).parameters
    key = "constexprs" if "constexprs" in params else "constants"
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, **{key: consts})
    options = {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
    compiled = triton.compile(src, target=target, options=options)
    newest = driver_ptx_isa()
    if newest is not None and ptx_isa(compiled.asm["ptx"]) > newest:  # written for a newer driver than this one
        compiled = triton.compile(src, target=target, options={**options, "ptx_version": newest})
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(compiled.metadata, scratch, 0):
            raise RuntimeError(f"the {what} kernel needs {scratch}: TensorRT AOT plugins cannot provide it")
    return compiled


@functools.cache
def paged_attention_kernel() -> Any:
    """`attention_kernel` over a paged cache: the same tiles, grouped heads, online softmax, WINDOW and SOFTCAP.

    Key positions t of a block of BLOCK_N are found one by one: block block_table[b, t // BLOCK_SIZE] (constexpr,
    a power of 2, any size against BLOCK_N), offset t % BLOCK_SIZE in the pools KP / VP [num_blocks, Hkv,
    BLOCK_SIZE, D]. The table is read only at positions the tile's rows may see (t <= its largest position, from
    the window's first block), so padding entries and blocks wholly before the window are never touched; keys at
    the row's new positions come from k_new / v_new as in the slot kernel. The group's first head's rows then store
    the row's real new tokens (s = 0 or position > 0, inside MAX_BLOCKS * BLOCK_SIZE) into their blocks (KP_OUT
    aliases KP). Blocks shared by rows (a cached prefix) are only read.
    """
    from llmc.engines.trt.triton_attention import llmc_paged_attention_fwd

    return llmc_paged_attention_fwd


def paged_kernel_constants(num_heads: int, kv_num_heads: int, head_dim: int, scale: float, block_m: int,
                           block_size: int, window: int = 0, softcap: float = 0.0) -> dict[str, int | float]:
    """The paged kernel's constexprs (in its parameter order): `kernel_constants` plus BLOCK_SIZE (a power of 2)."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2, got {block_size}")
    consts = kernel_constants(num_heads, kv_num_heads, head_dim, scale, block_m, window, softcap)
    return {**consts, "BLOCK_SIZE": int(block_size)}


def launch_paged_attention(q: Any, k_new: Any, v_new: Any, key_pool: Any, value_pool: Any, block_table: Any,
                           position_ids: Any, scale: float, block_m: int, window: int = 0,
                           softcap: float = 0.0) -> Any:
    """Run the paged kernel on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1); writes the pools in place.
    block_table: [B, max_blocks] int32 (contiguous), position_ids [B, S] int64."""
    import torch

    batch, heads, seq, dim = q.shape
    kv_heads, block_size = key_pool.shape[1], key_pool.shape[2]
    if block_table.dtype != torch.int32 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [{batch}, max_blocks] int32, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    out = torch.empty_like(q)
    consts = paged_kernel_constants(heads, kv_heads, dim, scale, block_m, block_size, window, softcap)
    grid = (math.ceil(seq * consts["G"] / block_m), batch * kv_heads)
    paged_attention_kernel()[grid](q, k_new, v_new, key_pool, value_pool, block_table, position_ids, seq,
                                   block_table.shape[1], out, key_pool, value_pool, **consts, num_warps=NUM_WARPS,
                                   num_stages=NUM_STAGES)
    return out


PAGED_SIGNATURE = ("Q", "KN", "VN", "KP", "VP", "BT", "POS", "S", "MAX_BLOCKS", "OUT", "KP_OUT", "VP_OUT")


def compile_paged_attention(dtype: str, num_heads: int, kv_num_heads: int, head_dim: int, scale: float,
                            block_m: int, block_size: int, target: Any = None, *, window: int = 0,
                            softcap: float = 0.0) -> Any:
    """Compile the paged kernel ahead of time (PTX) for `target` (default: this machine's GPU), as
    `compile_attention` does; BT is *i32, S and MAX_BLOCKS are i32 (the pools' num_blocks is not a parameter)."""
    consts = paged_kernel_constants(num_heads, kv_num_heads, head_dim, scale, block_m, block_size, window, softcap)
    special = {"S": "i32", "MAX_BLOCKS": "i32", "POS": "*i64", "BT": "*i32"}
    return _compile(paged_attention_kernel(), "paged attention", PAGED_SIGNATURE, special, dtype, consts, target)


def _entry(ptx: str, name: str) -> re.Match[str]:
    entry = re.search(rf"\.entry\s+{re.escape(name)}\s*\(([^)]*)\)", ptx)
    if entry is None:
        raise ValueError(f"the PTX has no entry {name}")
    return entry


def entry_parameters(ptx: str, name: str) -> list[str]:
    """The parameter names the PTX entry `name` declares, in order (ours, then any Triton appends)."""
    return [param.split()[-1] for param in _entry(ptx, name).group(1).split(",")]


def trim_parameters(ptx: str, name: str, keep: int) -> str:
    """The PTX with its entry `name` declaring only its first `keep` parameters.

    Triton appends two pointers to every kernel's parameters, its global and profile scratch. TensorRT's AOT launch
    passes the plugin's input pointers, extra ints and output pointers, no more, and the driver reads as many
    arguments as the entry declares. `_compile` refuses kernels whose scratch sizes are not 0, so the code never
    reads them; a dropped parameter the code does read is refused here."""
    entry = _entry(ptx, name)
    params = entry.group(1).split(",")
    for param in entry_parameters(ptx, name)[keep:]:
        if len(re.findall(rf"\b{re.escape(param)}\b", ptx)) > 1:  # more than its declaration
            raise RuntimeError(f"kernel {name} reads its parameter {param}, past the {keep} TensorRT passes")
    return ptx if len(params) <= keep else ptx[:entry.start(1)] + ",".join(params[:keep]) + "\n" + ptx[entry.end(1):]


_TRT_REGISTERED = False


def _aot_launch(trtp: Any, compiled: Any, q: Any, groups: int, kv_num_heads: int, block_m: int,
                last_int: Any, parameters: int) -> tuple[Any, Any, Any, Any]:
    """The AOT plugin's answer for a compiled kernel: its name, PTX (declaring our `parameters` only:
    `trim_parameters`), launch grid (tiles of block_m query rows x batch rows x KV heads) and its two int32
    arguments, S and `last_int` (MAX_SEQ or MAX_BLOCKS)."""
    seq = q.shape_expr[2]
    launch = trtp.KernelLaunchParams()
    launch.grid_x = trtp.cdiv(seq * groups, block_m)
    launch.grid_y = q.shape_expr[0] * kv_num_heads
    launch.block_x = compiled.metadata.num_warps * 32
    launch.shared_mem = compiled.metadata.shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(seq), trtp.SymInt32(last_int)])
    name = compiled.metadata.name
    return name, trim_parameters(compiled.asm["ptx"], name, parameters), launch, extra


def register_trt_plugin() -> None:
    """Register `llmc::attention` and `llmc::paged_attention` with TensorRT (shape/type description, formats, AOT
    Triton kernel). Idempotent.

    The plugin's attributes, in schema order: num_heads, kv_num_heads, head_dim (int), scale (float), block_m,
    window (int), softcap (float); `_describe` and `_aot` declare the same list (trt_lower writes every one).
    The paged plugin: inputs q, k_new, v_new, key_pool, value_pool [num_blocks, Hkv, block_size, D], block_table
    [B, max_blocks] int32, position_ids; outputs attn and the pools (aliased); the same attributes then block_size.
    """
    global _TRT_REGISTERED
    if _TRT_REGISTERED:
        return
    from typing import List, Tuple, Union  # noqa: UP035 - tensorrt.plugin checks these exact annotations

    import tensorrt as trt
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def _describe(q: trtp.TensorDesc, k_new: trtp.TensorDesc, v_new: trtp.TensorDesc, past_key: trtp.TensorDesc,
                  past_value: trtp.TensorDesc, position_ids: trtp.TensorDesc, num_heads: int, kv_num_heads: int,
                  head_dim: int, scale: float, block_m: int, window: int,
                  softcap: float) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:  # noqa: UP006
        return q.like(), past_key.aliased(), past_value.aliased()

    @trtp.autotune(PLUGIN_ID)
    def _formats(q: trtp.TensorDesc, k_new: trtp.TensorDesc, v_new: trtp.TensorDesc, past_key: trtp.TensorDesc,
                 past_value: trtp.TensorDesc, position_ids: trtp.TensorDesc,
                 outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:  # noqa: UP006
        return [trtp.AutoTuneCombination("FP16, FP16, FP16, FP16, FP16, INT64, FP16, FP16, FP16", "LINEAR")]

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(q: trtp.TensorDesc, k_new: trtp.TensorDesc, v_new: trtp.TensorDesc, past_key: trtp.TensorDesc,
             past_value: trtp.TensorDesc, position_ids: trtp.TensorDesc, num_heads: int, kv_num_heads: int,
             head_dim: int, scale: float, block_m: int, window: int, softcap: float,
             outputs: Tuple[trtp.TensorDesc],  # noqa: UP006
             tactic: int) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,  # noqa: UP006, UP007
                                   trtp.SymExprs]:
        if q.dtype != trt.float16:
            raise ValueError(f"llmc::attention runs in fp16, got {q.dtype}")
        compiled = compile_attention("float16", num_heads, kv_num_heads, head_dim, scale, block_m, window=window,
                                     softcap=softcap)
        return _aot_launch(trtp, compiled, q, num_heads // kv_num_heads, kv_num_heads, block_m,
                           past_key.shape_expr[2], len(SIGNATURE))

    @trtp.register(PAGED_PLUGIN_ID)
    def _describe_paged(q: trtp.TensorDesc, k_new: trtp.TensorDesc, v_new: trtp.TensorDesc,
                        key_pool: trtp.TensorDesc, value_pool: trtp.TensorDesc, block_table: trtp.TensorDesc,
                        position_ids: trtp.TensorDesc, num_heads: int, kv_num_heads: int, head_dim: int,
                        scale: float, block_m: int, window: int, softcap: float,
                        block_size: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:  # noqa: UP006
        return q.like(), key_pool.aliased(), value_pool.aliased()

    @trtp.autotune(PAGED_PLUGIN_ID)
    def _formats_paged(q: trtp.TensorDesc, k_new: trtp.TensorDesc, v_new: trtp.TensorDesc,
                       key_pool: trtp.TensorDesc, value_pool: trtp.TensorDesc, block_table: trtp.TensorDesc,
                       position_ids: trtp.TensorDesc,
                       outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:  # noqa: UP006
        return [trtp.AutoTuneCombination("FP16, FP16, FP16, FP16, FP16, INT32, INT64, FP16, FP16, FP16", "LINEAR")]

    @trtp.aot_impl(PAGED_PLUGIN_ID)
    def _aot_paged(q: trtp.TensorDesc, k_new: trtp.TensorDesc, v_new: trtp.TensorDesc, key_pool: trtp.TensorDesc,
                   value_pool: trtp.TensorDesc, block_table: trtp.TensorDesc, position_ids: trtp.TensorDesc,
                   num_heads: int, kv_num_heads: int, head_dim: int, scale: float, block_m: int, window: int,
                   softcap: float, block_size: int,
                   outputs: Tuple[trtp.TensorDesc],  # noqa: UP006
                   tactic: int) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,  # noqa: UP006, UP007
                                         trtp.SymExprs]:
        if q.dtype != trt.float16:
            raise ValueError(f"llmc::paged_attention runs in fp16, got {q.dtype}")
        compiled = compile_paged_attention("float16", num_heads, kv_num_heads, head_dim, scale, block_m, block_size,
                                           window=window, softcap=softcap)
        return _aot_launch(trtp, compiled, q, num_heads // kv_num_heads, kv_num_heads, block_m,
                           block_table.shape_expr[1], len(PAGED_SIGNATURE))

    _TRT_REGISTERED = True
