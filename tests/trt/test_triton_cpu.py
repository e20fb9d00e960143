"""The Triton attention kernel checked without a GPU: run by Triton's interpreter (numpy) against the reference, and
compiled ahead of time to PTX for Ampere and Hopper exactly as the TensorRT plugin's aot_impl does.
Skipped where triton is not installed (it comes with torch on GPU machines; `pip install triton` works on a CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# triton (dev extra) and torch (export extra) are test dependencies: no skip, a missing one is a failure.
import torch  # noqa: F401
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
