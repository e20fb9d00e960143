"""scripts/bench_decode_attention.c: built from the operators' sources as its header says, it runs SmolLM2's 30 layers
of decode attention cold, hot and the read probe over the same pools, on the AVX-512 and the portable paths, and
refuses bad arguments."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from c_harness import build

HEAD = re.compile(r"(\d+) thread\(s\), (\d+) row\(s\), (\d+) cached tokens a row \(\+(\d+) steps\): a step's attention "
                  r"reads ([\d.]+) MB")
TIMED = re.compile(r"  (cold \(the engine's case\)|hot \(in cache\)) +([\d.]+) ms = +([\d.]+) GB/s, +([\d.]+) us a layer")
READ = re.compile(r"  read probe +([\d.]+) ms = +([\d.]+) GB/s over the pools' ([\d.]+) MB")


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("bench_decode_attention.c", ("attention_kernel.c", "amx_bf16.c", "pool.c", "ahead.c", "bandwidth.c"),
                 tmp_path_factory.mktemp("attention") / "bench_decode_attention")


@pytest.mark.parametrize(("rows", "context", "generic"), [(1, 300, False), (3, 70, False), (2, 300, True)])
def test_the_attention_and_the_probe_read_the_same_pools(harness: Path, rows: int, context: int,
                                                         generic: bool) -> None:
    """A long row split along its keys (300 > 256) and short rows in one block; LLMC_KERNELS_GENERIC: the portable
    loops, as on a CPU without AVX-512."""
    env = {**os.environ, **({"LLMC_KERNELS_GENERIC": "1"} if generic else {})}
    done = subprocess.run([str(harness), "2", str(rows), str(context), "20"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    head, cold, hot, read = done.stdout.strip().split("\n")
    m = HEAD.fullmatch(head)
    assert m and (m[1], m[2], m[3], m[4]) == ("2", str(rows), str(context), "20"), head
    # 30 layers x K and V x 3 KV heads x (the mean context over the steps) x 64 dims x 2 bytes
    assert float(m[5]) == pytest.approx(30 * 2 * rows * 3 * (context + 10) * 64 * 2 / 1e6, abs=0.051)
    for line, name in ((cold, "cold"), (hot, "hot")):
        t = TIMED.fullmatch(line)
        assert t and t[1].startswith(name), line
        ms, gbs, us = float(t[2]), float(t[3]), float(t[4])
        assert ms > 0 and us == pytest.approx(ms * 1e3 / 30, rel=0.01, abs=0.051)
        # GB/s to 0.1, from the unrounded MB (printed to 0.1) and ms (to 0.001): within those roundings
        mb = float(m[5])
        assert gbs == pytest.approx(mb / ms, abs=0.0501 + mb / ms * (0.0501 / mb + 0.000501 / ms))
    r = READ.fullmatch(read)
    assert r, read
    blocks = rows * -(-(context + 20) // 64)  # each row's blocks of 64 positions, the pools' whole
    assert float(r[3]) == pytest.approx(30 * 2 * blocks * 3 * 64 * 64 * 2 / 1e6, abs=0.051)
    pools, read_ms = float(r[3]), float(r[1])
    assert float(r[2]) == pytest.approx(pools / read_ms, abs=0.0501 + pools / read_ms * (0.0501 / pools + 0.000501 / read_ms))


@pytest.mark.parametrize("args", [["0"], ["2", "0"], ["2", "1", "0"], ["2", "1", "100", "5"], ["2", "65", "100"]])
def test_bad_arguments_get_a_usage_line(harness: Path, args: list[str]) -> None:
    done = subprocess.run([str(harness), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: bench_decode_attention") and done.stderr.count("\n") == 1
