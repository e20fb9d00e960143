"""The TensorRT plugins' ahead-of-time kernels launched as TensorRT's AOT plugin launcher launches them, without
TensorRT: the plugin's answer (`plugin._aot_launch`: kernel name, PTX, grid, block, shared memory, the extra int32
arguments) taken over concrete shapes, the PTX loaded by the CUDA driver's compiler (ctypes on libcuda), the
arguments in TensorRT's order (input pointers, the extra int32s, output pointers, an aliased output on
its input's memory), the result checked against torch's scaled_dot_product_attention and the written cache.

Used by tests/trt/test_gpu_kernels.py and scripts/gpu_check.sh (its aot step). `python -m trt.aot_launch save
FILE` writes the answers of this machine's Triton (no GPU needed: the pinned release compiles for sm_90 on a CPU)
for `python -m trt.aot_launch run [FILE]` to launch on a GPU machine that lacks that release, beside the answers
of the Triton found there.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

# (kind, batch, heads, kv_heads, head_dim, length, paged): prefill of `length` tokens, or decode after `length - 1`.
CASES = [
    ("prefill", 1, 9, 3, 64, 17, False), ("decode", 64, 9, 3, 64, 640, False),
    ("prefill", 2, 32, 8, 128, 1000, False), ("decode", 8, 32, 8, 128, 2048, False),
    ("prefill", 4, 9, 3, 64, 128, True), ("decode", 1, 9, 3, 64, 513, True),
]
MAX_SEQ = 2048
BLOCK_SIZE = 16  # the paged cases' block size
SHARED_OPT_IN = 48 * 1024  # above this a launch needs CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class NumericPlugin:
    """The slice of tensorrt.plugin that `_aot_launch` uses, over numbers instead of symbolic shapes."""

    class KernelLaunchParams:
        def __init__(self) -> None:
            self.grid_x = self.grid_y = self.grid_z = 1
            self.block_x = self.block_y = self.block_z = 1
            self.shared_mem = 0

    class SymIntExprs:
        @staticmethod
        def from_tuple(values: tuple) -> tuple[int, ...]:
            return tuple(int(v) for v in values)

    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    @staticmethod
    def SymInt32(value: int) -> int:  # noqa: N802 - tensorrt.plugin's name
        return int(value)


class Desc:
    """A TensorDesc's shape as `_aot_launch` reads it."""

    def __init__(self, *shape: int) -> None:
        self.shape_expr = shape


def answer(kind: str, batch: int, heads: int, kv_heads: int, dim: int, length: int, paged: bool,
           target: Any = None) -> dict[str, Any]:
    """What the plugin's aot_impl answers TensorRT for one case (`target` None: this machine's GPU)."""
    import triton

    from llmc.engines.trt import plugin
    from llmc.engines.trt.lower import BLOCK_M

    seq = length if kind == "prefill" else 1
    block_m, scale = BLOCK_M["prefill" if kind == "prefill" else "decode"], dim ** -0.5
    if paged:
        compiled = plugin.compile_paged_attention("float16", heads, kv_heads, dim, scale, block_m, BLOCK_SIZE, target)
        last, parameters = MAX_SEQ // BLOCK_SIZE, len(plugin.PAGED_SIGNATURE)  # MAX_BLOCKS: block_table's shape
    else:
        compiled = plugin.compile_attention("float16", heads, kv_heads, dim, scale, block_m, target)
        last, parameters = MAX_SEQ, len(plugin.SIGNATURE)  # MAX_SEQ: past_key's shape
    name, ptx, launch, extra = plugin._aot_launch(NumericPlugin, compiled, Desc(batch, heads, seq, dim),
                                                  heads // kv_heads, kv_heads, block_m, last, parameters)
    return {"case": [kind, batch, heads, kv_heads, dim, length, paged], "triton": triton.__version__, "name": name,
            "ptx": ptx, "isa": plugin.ptx_isa(ptx), "grid": [launch.grid_x, launch.grid_y, launch.grid_z],
            "block": [launch.block_x, launch.block_y, launch.block_z], "shared": launch.shared_mem,
            "extra": list(extra)}


class Driver:
    """cuModuleLoadData / cuModuleGetFunction / cuLaunchKernel on the current (torch's primary) context."""

    def __init__(self) -> None:
        import torch

        torch.zeros(1, device="cuda")  # the primary context, current on this thread
        self.cuda = cuda = ctypes.CDLL("libcuda.so.1")
        vp, u = ctypes.c_void_p, ctypes.c_uint
        cuda.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        cuda.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        cuda.cuFuncSetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_int]
        cuda.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
        cuda.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        version = ctypes.c_int(0)
        self._check(cuda.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.version = version.value

    def _check(self, rc: int, what: str) -> None:
        if rc:
            name = ctypes.c_char_p()
            self.cuda.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: {(name.value or b'CUDA error').decode()} ({rc})")

    def function(self, ptx: str, name: str) -> ctypes.c_void_p:
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(module), ptx.encode() + b"\0"), "cuModuleLoadData")
        self._check(self.cuda.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), "cuModuleGetFunction")
        return fn

    def launch(self, fn: ctypes.c_void_p, grid: list[int], block: list[int], shared: int, args: list[Any],
               stream: int) -> None:
        if shared > SHARED_OPT_IN:
            self._check(self.cuda.cuFuncSetAttribute(fn, 8, shared), "cuFuncSetAttribute")  # max dynamic shared
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self._check(self.cuda.cuLaunchKernel(fn, *grid, *block, shared, stream, params, None), "cuLaunchKernel")


def run(record: dict[str, Any], driver: Driver) -> dict[str, Any]:
    """Launch one answer as TensorRT would and compare: relative max error against SDPA, the cache (slots or
    pool) equal to the expected one bit for bit, and how the PTX's parameters split into ours and Triton's."""
    import torch
    import torch.nn.functional as F

    from llmc.engines.trt.plugin import entry_parameters

    from .kernel_bench import to_pool

    kind, batch, heads, kv_heads, dim, length, paged = record["case"]
    torch.manual_seed(0)
    dev, f16 = "cuda", torch.float16
    seq = length if kind == "prefill" else 1
    start = length - seq
    q = torch.randn(batch, heads, seq, dim, device=dev, dtype=f16)
    k_new, v_new = (torch.randn(batch, kv_heads, seq, dim, device=dev, dtype=f16) for _ in range(2))
    cache_k, cache_v = (torch.randn(batch, kv_heads, MAX_SEQ, dim, device=dev, dtype=f16) for _ in range(2))
    pos = (start + torch.arange(seq, device=dev)).expand(batch, seq).contiguous()
    want_k, want_v = cache_k.clone(), cache_v.clone()
    want_k[:, :, start:length], want_v[:, :, start:length] = k_new, v_new
    ref = F.scaled_dot_product_attention(q, want_k[:, :, :length], want_v[:, :, :length], is_causal=kind == "prefill",
                                         scale=dim ** -0.5, enable_gqa=True)
    out = torch.empty_like(q)
    max_blocks = MAX_SEQ // BLOCK_SIZE
    table = torch.randperm(batch * max_blocks, device=dev).to(torch.int32).view(batch, max_blocks)

    def pool(cache: Any) -> Any:
        return to_pool(cache, table, BLOCK_SIZE)

    if paged:
        kc, vc = pool(cache_k), pool(cache_v)
        inputs, want = [q, k_new, v_new, kc, vc, table, pos], (pool(want_k), pool(want_v))
    else:
        kc, vc = cache_k, cache_v
        inputs, want = [q, k_new, v_new, kc, vc, pos], (want_k, want_v)
    ours = [ctypes.c_void_p(t.data_ptr()) for t in inputs] + [ctypes.c_int32(v) for v in record["extra"]] + \
        [ctypes.c_void_p(t.data_ptr()) for t in (out, kc, vc)]  # the outputs alias their caches
    declared = len(entry_parameters(record["ptx"], record["name"]))
    hidden = [ctypes.c_void_p(None) for _ in range(declared - len(ours))]  # answers saved before the trimming
    fn = driver.function(record["ptx"], record["name"])
    driver.launch(fn, record["grid"], record["block"], record["shared"], ours + hidden,
                  torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    return {"rel_err": err, "kv_equal": bool(torch.equal(kc, want[0]) and torch.equal(vc, want[1])),
            "params": f"{len(ours)}+{len(hidden)}"}


def label(record: dict[str, Any]) -> str:
    kind, batch, heads, kv_heads, dim, length, paged = record["case"]
    return (f"  aot triton {record['triton']} ptx {record['isa'] // 10}.{record['isa'] % 10} "
            f"{'paged' if paged else 'slot'} {kind} b={batch} h={heads}/{kv_heads} d={dim} t={length}")


def check(record: dict[str, Any], driver: Driver) -> tuple[bool, str]:
    """(ok, detail) for one answer. PTX newer than the driver compiles must be refused with
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION (it shows why `_compile` writes for the driver's ISA); all else must run."""
    from llmc.engines.trt.plugin import cuda_ptx_isa

    newest = cuda_ptx_isa(driver.version)
    try:
        r = run(record, driver)
    except RuntimeError as e:
        refused = record["isa"] > newest and "UNSUPPORTED_PTX_VERSION" in str(e)
        return refused, f"{'refused as expected' if refused else 'FAILED'} ({e}; the driver compiles <= " \
                        f"{newest // 10}.{newest % 10})"
    ok = r["rel_err"] <= 1e-2 and r["kv_equal"]
    return ok, (f"rel err {r['rel_err']:.1e}  kv equal {r['kv_equal']}  params {r['params']}  "
                f"shared {record['shared']}  grid {record['grid'][:2]}")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "save":
        from triton.backends.compiler import GPUTarget

        from llmc.engines.trt import plugin

        with open(argv[1], "w") as f:
            for newest in (None, 90):  # as Triton writes it, and for a CUDA 13.0 driver (R580)
                plugin.driver_ptx_isa = lambda newest=newest: newest  # type: ignore[assignment]
                for case in CASES:
                    f.write(json.dumps(answer(*case, target=GPUTarget("cuda", 90, 32))) + "\n")
        return 0
    if not argv or argv[0] != "run":
        print("usage: python -m trt.aot_launch save FILE | run [FILE] [ROWS]", file=sys.stderr)
        return 2
    records = [answer(*case) for case in CASES]
    if len(argv) > 1 and argv[1]:
        records += [json.loads(line) for line in open(argv[1])]
    driver, failed = Driver(), 0
    rows = open(argv[2], "a") if len(argv) > 2 else None
    for record in records:
        ok, detail = check(record, driver)
        failed += not ok
        print(f"{label(record)}: {'ok' if ok else 'FAIL'}  {detail}", flush=True)
        if rows:
            rows.write(json.dumps({"step": label(record), "status": "ok" if ok else "FAIL", "seconds": "",
                                   "detail": detail}) + "\n")
    print(f"{len(records) - failed}/{len(records)} AOT launches ok (driver {driver.version})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
