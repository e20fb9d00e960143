"""scripts/hot_product.c: built from the operators' sources as its header says, it times one 4-bit product with its
weights in the caches against vpdpbusd's rate measured in the same run, on this CPU's paths and the portable ones,
and refuses bad arguments."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from c_harness import build

from llmc.engines.kernels import cpu_paths

LINE = re.compile(r"K (\d+) N (\d+) rows (\d+) act_bits (\d+) threads (\d+): ([\d.]+) us a call"
                  r"(?:, ([\d.]+) G vpdpbusd/s, (\d+) % of vpdpbusd's ([\d.]+) G/s)?")


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("hot_product.c", ("matmul_q4.c", "matmul_bf16.c", "matrix_peak.c", "ahead.c", "amx_bf16.c",
                                   "pool.c"), tmp_path_factory.mktemp("hot") / "hot_product")


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("act_bits", [8, 16])
def test_one_product_is_timed_against_vpdpbusd_s_rate(harness: Path, generic: bool, act_bits: int) -> None:
    env = {**os.environ, **({"LLMC_KERNELS_GENERIC": "1"} if generic else {})}
    done = subprocess.run([str(harness), "576", "64", "8", str(act_bits), "2", "20"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    m = LINE.fullmatch(done.stdout.strip())
    assert m, done.stdout
    assert tuple(map(int, m.groups()[:5])) == (576, 64, 8, act_bits, 2) and float(m[6]) > 0
    vnni = not generic and cpu_paths()["matmul_q4"].startswith("avx512-vnni")
    assert (m[7] is not None) == vnni  # a rate only where the product takes vpdpbusd
    if vnni:
        issued = 8 * 576 * 64 / 64 * (2 if act_bits == 16 else 1) / (float(m[6]) * 1e3)  # G a second
        assert float(m[7]) == pytest.approx(issued, rel=0.02, abs=0.006)
        assert int(m[8]) == pytest.approx(100 * issued / float(m[9]), abs=1.01)


@pytest.mark.parametrize("args", [["33"], ["576", "64", "0"], ["576", "64", "8", "12"], ["576", "64", "8", "8", "2",
                                                                                            "5"]])
def test_bad_arguments_get_a_usage_line(harness: Path, args: list[str]) -> None:
    done = subprocess.run([str(harness), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: hot_product") and done.stderr.count("\n") == 1
