"""The Triton attention kernel checked without a GPU: run by Triton's interpreter (numpy) against the reference, and
compiled ahead of time to PTX for Ampere and Hopper exactly as the TensorRT plugin's aot_impl does.
Skipped where triton is not installed (it comes with torch on GPU machines; `pip install triton` works on a CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# triton (dev extra) and torch (export extra) are test dependencies: no skip, a missing one is a failure.
import torch  # noqa: F401
import triton  # noqa: F401

SCRIPT = Path(__file__).with_name("triton_interpret_check.py")


def test_kernel_matches_reference_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 8
    for r in results:
        bound = 1e-5 if r["dtype"] == "float32" else 1e-2 * r["scale"]
        assert r["out_err"] <= bound, r
        assert r["cache_err"] == 0.0, r  # new K/V are copied into the cache bit for bit


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("block_m", [16, 64])
def test_kernel_compiles_ahead_of_time(capability: int, block_m: int) -> None:
    from triton.backends.compiler import GPUTarget

    from llmc.engines.trt_plugin import NUM_WARPS, SIGNATURE, compile_attention

    compiled = compile_attention("float16", 9, 3, 64, 0.125, block_m, target=GPUTarget("cuda", capability, 32))
    ptx = compiled.asm["ptx"]
    assert f".target sm_{capability}" in ptx
    entry = re.search(r"\.entry\s+(\w+)\(([^)]*)\)", ptx)
    assert entry is not None and entry.group(1) == compiled.metadata.name
    params = entry.group(2).count(".param")
    assert params >= len(SIGNATURE)  # ours first; newer Triton appends scratch pointers (checked to be unused)
    assert compiled.metadata.num_warps == NUM_WARPS and compiled.metadata.shared > 0
