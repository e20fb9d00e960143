"""The Triton attention kernel checked without a GPU: run by Triton's interpreter (numpy) against the reference, and
compiled ahead of time to PTX for Ampere and Hopper exactly as the TensorRT plugin's aot_impl does.
Skipped where triton is not installed (it comes with torch on GPU machines; `pip install triton` works on a CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# triton (dev extra) and torch (export extra) are test dependencies: no skip, a missing one is a failure.
import torch
import triton  # noqa: F401

from .interpreter_run import run_interpreter

SCRIPT = Path(__file__).with_name("triton_interpret_check.py")


def test_kernel_matches_reference_in_the_interpreter() -> None:
    results = run_interpreter(SCRIPT)
    assert len(results) == 2 * 9  # fp32 and fp16: the 9 cases of CASES
    for r in results:
        bound = 1e-5 if r["dtype"] == "float32" else 1e-2 * r["scale"]
        assert r["out_err"] <= bound, r  # NaN (a skipped block was read) fails this too
        assert r["cache_err"] == 0.0, r  # new K/V are copied into the cache bit for bit
        assert r["finite"], r  # pad rows included
    windowed = {r["case"]: r["skipped"] for r in results if "window" in r["case"]}
    assert windowed["decode-window"] == 128 and windowed["chunk-window-softcap"] == 128  # whole blocks skipped


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("block_m", [16, 64])
def test_kernel_compiles_ahead_of_time(capability: int, block_m: int) -> None:
    from triton.backends.compiler import GPUTarget

    from llmc.engines.trt.plugin import NUM_WARPS, SIGNATURE, compile_attention

    compiled = compile_attention("float16", 9, 3, 64, 0.125, block_m, target=GPUTarget("cuda", capability, 32))
    ptx = compiled.asm["ptx"]
    assert f".target sm_{capability}" in ptx
    entry = re.search(r"\.entry\s+(\w+)\(([^)]*)\)", ptx)
    assert entry is not None and entry.group(1) == compiled.metadata.name
    params = entry.group(2).count(".param")
    assert params >= len(SIGNATURE)  # ours first; newer Triton appends scratch pointers (checked to be unused)
    assert compiled.metadata.num_warps == NUM_WARPS and compiled.metadata.shared > 0


def test_windowed_softcapped_kernel_compiles_ahead_of_time() -> None:
    """Gemma 2's constants (window 4096, softcap 50): the tanh (via exp2) and the window's start lower to PTX."""
    from triton.backends.compiler import GPUTarget

    from llmc.engines.trt.plugin import compile_attention

    plain = compile_attention("float16", 8, 4, 256, 0.0625, 16, target=GPUTarget("cuda", 90, 32))
    capped = compile_attention("float16", 8, 4, 256, 0.0625, 16, target=GPUTarget("cuda", 90, 32), window=4096,
                               softcap=50.0)
    assert plain.asm["ptx"] != capped.asm["ptx"]  # (compile_attention refuses kernels needing scratch)
    assert ".target sm_90" in capped.asm["ptx"]


@pytest.mark.parametrize("cuda, isa", [(11080, 78), (12000, 80), (12050, 85), (12060, 85), (12080, 87), (12090, 88),
                                       (13000, 90), (13020, 92), (14010, 101)])
def test_ptx_isa_of_a_cuda_release(cuda: int, isa: int) -> None:
    from llmc.engines.trt.plugin import cuda_ptx_isa

    assert cuda_ptx_isa(cuda) == isa


def test_ptx_isa_read_from_the_module() -> None:
    from llmc.engines.trt.plugin import cuda_ptx_isa, ptx_isa

    assert ptx_isa("//\n// Generated\n.version 9.4\n.target sm_90a\n") == 94
    with pytest.raises(ValueError, match="no .version"):
        ptx_isa(".target sm_90a\n")
    with pytest.raises(ValueError, match="10.2"):
        cuda_ptx_isa(10020)


def test_kernel_written_for_an_older_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA 12.6 driver compiles PTX up to 8.5; Triton 3.9 writes 9.4 (its CUDA 13.4 ptxas), which that driver
    (TensorRT hands it the PTX) refuses: the kernel is written again for 8.5. A newer driver keeps Triton's ISA."""
    from triton.backends.compiler import GPUTarget

    from llmc.engines.trt import plugin

    monkeypatch.setattr(plugin, "driver_ptx_isa", lambda: 999)
    newest = plugin.ptx_isa(plugin.compile_attention("float16", 9, 3, 64, 0.125, 16, GPUTarget("cuda", 90, 32))
                            .asm["ptx"])
    assert newest > 85
    monkeypatch.setattr(plugin, "driver_ptx_isa", lambda: 85)
    for compiled in (plugin.compile_attention("float16", 9, 3, 64, 0.125, 16, GPUTarget("cuda", 90, 32)),
                     plugin.compile_paged_attention("float16", 9, 3, 64, 0.125, 16, 16, GPUTarget("cuda", 90, 32))):
        assert plugin.ptx_isa(compiled.asm["ptx"]) == 85
        assert ".target sm_90" in compiled.asm["ptx"]


@pytest.mark.parametrize("case, grid, extra", [
    (("prefill", 2, 32, 8, 128, 1000, False), [63, 16, 1], [1000, 2048]),  # 1000 tokens x 4 heads / 64 rows
    (("decode", 3, 9, 3, 64, 513, True), [1, 9, 1], [1, 128]),  # MAX_BLOCKS 2048 / 16
])
def test_aot_answer_for_tensorrt(case: tuple, grid: list[int], extra: list[int]) -> None:
    """The plugin's AOT answer over concrete shapes: tiles of BLOCK_M (query, group head) rows x batch rows x KV
    heads, 4 warps, the shared memory Triton reports, S and MAX_SEQ (or MAX_BLOCKS) as the extra int32s, and a PTX
    entry declaring TensorRT's arguments (inputs, extras, outputs) before any Triton adds."""
    from triton.backends.compiler import GPUTarget

    from llmc.engines.trt.plugin import NUM_WARPS, PAGED_SIGNATURE, SIGNATURE, entry_parameters

    from .aot_launch import SHARED_OPT_IN, answer

    record = answer(*case, target=GPUTarget("cuda", 90, 32))
    assert record["grid"] == grid and record["extra"] == extra
    assert record["block"] == [NUM_WARPS * 32, 1, 1] and 0 < record["shared"] <= SHARED_OPT_IN
    assert len(entry_parameters(record["ptx"], record["name"])) == len(PAGED_SIGNATURE if case[6] else SIGNATURE)


def test_the_plugins_ptx_declares_what_tensorrt_passes(tmp_path: Path) -> None:
    """Triton's two scratch pointers are left out of the entry TensorRT launches (inputs, extras, outputs), and the
    PTX still assembles (Triton's own ptxas); a parameter the code reads is never dropped."""
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    from llmc.engines.trt.plugin import SIGNATURE, compile_attention, entry_parameters, trim_parameters

    compiled = compile_attention("float16", 9, 3, 64, 0.125, 16, GPUTarget("cuda", 90, 32))
    name, ptx = compiled.metadata.name, compiled.asm["ptx"]
    assert len(entry_parameters(ptx, name)) == len(SIGNATURE) + 2  # Triton's global and profile scratch
    trimmed = trim_parameters(ptx, name, len(SIGNATURE))
    assert entry_parameters(trimmed, name) == entry_parameters(ptx, name)[:len(SIGNATURE)]
    assert trim_parameters(trimmed, name, len(SIGNATURE)) == trimmed
    (tmp_path / "k.ptx").write_text(trimmed)
    subprocess.run([get_ptxas(90).path, "-arch=sm_90a", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                   check=True, capture_output=True)
    with pytest.raises(RuntimeError, match=rf"reads its parameter {name}_param_10, past the 10"):
        trim_parameters(ptx, name, len(SIGNATURE) - 1)  # VC_OUT, which the kernel stores to


def test_a_single_rows_pool_is_laid_out_as_the_kernel_reads_it() -> None:
    """The GPU checks' slot-to-pool helper (kernel_bench.to_pool): one row's pool comes out contiguous, each table
    entry's block holding its positions. (With empty_like it kept the row's transposed strides, and the paged
    kernel, reading it as laid out, failed a b=1 case on the H200 for the harness's sake alone.)"""
    from .kernel_bench import to_pool

    cache = torch.randn(1, 3, 64, 8)
    table = torch.randperm(4).to(torch.int32).view(1, 4)
    pool = to_pool(cache, table, 16)
    assert pool.is_contiguous() and pool.shape == (4, 3, 16, 8)
    for i in range(4):
        assert torch.equal(pool[table[0, i]], cache[0, :, i * 16:(i + 1) * 16])
