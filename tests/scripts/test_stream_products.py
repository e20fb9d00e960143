"""scripts/stream_products.c: built from the operators' sources as its header says, it runs SmolLM2's 121 decode
products and the read probe over the same bytes, for each prefetch setting, and refuses bad arguments."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from c_harness import build

LINE = re.compile(r"LLMC_PREFETCH=(\S+) rows (\d+) act_bits (\d+): ([\d.]+) MB; products ([\d.]+) ms = ([\d.]+) GB/s; "
                  r"probe ([\d.]+) GB/s whole, ([\d.]+) in the products' chunks; products / probe ([\d.]+)")


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("stream_products.c", ("matmul_q4.c", "ahead.c", "amx_bf16.c", "pool.c", "bandwidth.c"),
                 tmp_path_factory.mktemp("stream") / "stream_products")


@pytest.mark.parametrize(("prefetch", "generic"), [("l2", False), ("l2x3", False), ("l2", True)])
def test_the_products_and_the_probe_stream_the_same_bytes(harness: Path, prefetch: str, generic: bool) -> None:
    """Each prefetch setting on this CPU's paths, and the portable ones (LLMC_KERNELS_GENERIC: the products' C loop
    and the probe's, as on a CPU without AVX-512)."""
    env = {**os.environ, "LLMC_PREFETCH": prefetch, **({"LLMC_KERNELS_GENERIC": "1"} if generic else {})}
    done = subprocess.run([str(harness), "2", "1", "20", "8"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    m = LINE.fullmatch(done.stdout.strip())
    assert m, done.stdout
    assert (m[1], m[2], m[3]) == (prefetch, "1", "8")
    assert float(m[4]) == pytest.approx(98.2, abs=0.1)  # SmolLM2's 120 4-bit products and its 8-bit head
    mb, ms, gbs, whole, chunked, ratio = (float(m[i]) for i in range(4, 10))
    assert gbs > 0 and whole > 0 and chunked > 0
    # GB/s printed to 0.1, from the unrounded MB (printed to 0.1) and ms (to 0.001): within those roundings
    assert gbs == pytest.approx(mb / ms, abs=0.0501 + mb / ms * (0.0501 / mb + 0.000501 / ms))
    assert ratio == pytest.approx(mb / ms / whole, rel=0.01, abs=6e-4)  # (the ratio to 0.001, the probe to 0.1)


@pytest.mark.parametrize("args", [["0"], ["2", "0"], ["2", "1", "5"]])
def test_bad_arguments_get_a_usage_line(harness: Path, args: list[str]) -> None:
    done = subprocess.run([str(harness), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: stream_products") and done.stderr.count("\n") == 1
