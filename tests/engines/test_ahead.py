"""Reading ahead (llmc/engines/kernels/ahead.c): after their share of each call, llmc's idle pool workers prefetch the
part of the next decode product's weights each of them will stream, the next product learned from the order the
products ran in last time. It is a hint: it never changes a result, and LLMC_AHEAD_KB=0 turns it off."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from llmc.engines.kernels import _library
from llmc.graph.quant import pack_bf16_tiles, pack_q4_tiles

from .test_matmul_q4 import _session

X86 = platform.machine() in ("x86_64", "AMD64", "i386", "i686")  # elsewhere reading ahead is off (x86's prefetch)


def _lib() -> ctypes.CDLL:
    lib = _library()
    for name in ("llmc_ops_ahead_check", "llmc_ops_ahead_bytes", "llmc_ops_ahead_kb"):
        getattr(lib, name).restype = ctypes.c_longlong
    lib.llmc_ops_ahead_set_kb.argtypes = [ctypes.c_longlong]
    return lib


@pytest.fixture
def set_kb() -> Iterator[Callable[[int], None]]:
    """Sets how far the workers read ahead for one test, and puts back what it was."""
    lib = _lib()
    kept = lib.llmc_ops_ahead_kb()
    yield lib.llmc_ops_ahead_set_kb
    lib.llmc_ops_ahead_set_kb(kept)


@pytest.mark.parametrize("threads", [2, 3])
def test_idle_workers_read_ahead_of_the_product_that_ran_next(set_kb: Callable[[int], None], threads: int) -> None:
    """Three products in turn, the caller busy for 20 us between two: each learns which product came next (else
    -3), and the workers prefetch its weights while they wait (bytes > 0). Off the x86 CPUs it stays off."""
    set_kb(2048)
    for gap_us in (20, 200, 2000):  # longer gaps when the machine is busy: a worker reads ahead only while idle
        result = _lib().llmc_ops_ahead_check(threads, 100, 4096, gap_us)
        if result != 0:
            break
    if X86:
        assert _lib().llmc_ops_ahead_kb() == 2048 and result > 0
    else:
        assert _lib().llmc_ops_ahead_kb() == 0 and result == -3


def test_turned_off_it_prefetches_nothing(set_kb: Callable[[int], None]) -> None:
    lib = _lib()
    set_kb(0)
    assert lib.llmc_ops_ahead_kb() == 0
    before = lib.llmc_ops_ahead_bytes()
    assert lib.llmc_ops_ahead_check(2, 50, 4096, 20) in (0, -3)  # (-3: nothing learned; 0: learned before)
    assert lib.llmc_ops_ahead_bytes() == before


def test_llmc_ahead_kb_0_turns_it_off_in_a_new_process() -> None:
    code = ("import ctypes; from llmc.engines.kernels import _library; lib = _library(); "
            "lib.llmc_ops_ahead_check.restype = lib.llmc_ops_ahead_bytes.restype = ctypes.c_longlong; "
            "print(lib.llmc_ops_ahead_check(2, 50, 4096, 20), lib.llmc_ops_ahead_bytes(), lib.llmc_ops_ahead_kb())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LLMC_AHEAD_KB": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["-3", "0", "0"]


@pytest.mark.parametrize("op", ["MatMulQ4", "MatMulBF16"])
def test_products_on_llmcs_pool_give_the_same_bits_reading_ahead_or_not(llmc_ops: Path,
                                                                        set_kb: Callable[[int], None],
                                                                        op: str) -> None:
    """Two products in turn on llmc's pool of 2 threads, decode rows and batch 8 (each thread takes its own part
    first, the part its idle time read ahead, and every part runs once), against one thread."""
    rng = np.random.default_rng(7)
    k, n = 192, 320
    pack = pack_bf16_tiles if op == "MatMulBF16" else pack_q4_tiles
    packed = [pack(rng.standard_normal((k, n)).astype(np.float32)) for _ in range(2)]
    xs = [rng.standard_normal((rows, 1, k)).astype(np.float32) for rows in (1, 8)]

    def run(threads: int, own_pool: bool) -> list[np.ndarray]:
        sessions = [_session(llmc_ops, k, n, w, None, False, threads, threads, op=op, own_pool=own_pool)
                    for w in packed]
        return [s.run(None, {"x": x})[0] for _ in range(20) for x in xs for s in sessions]  # type: ignore[attr-defined]

    alone = run(1, False)
    for kb in (2048, 0):
        set_kb(kb)
        for got, expected in zip(run(2, True), alone, strict=True):
            np.testing.assert_array_equal(got, expected)


def test_concurrent_callers_keep_their_bits_while_the_workers_read_ahead(llmc_ops: Path,
                                                                         set_kb: Callable[[int], None]) -> None:
    """Two threads run their own products on llmc's pool at once (one holds the pool, the other runs its tasks in
    its own thread), so the successors learned are interleaved and the hints wrong half the time: every result
    stays the bits of one thread alone."""
    import threading

    set_kb(2048)
    rng = np.random.default_rng(11)
    k, n = 256, 640
    cases = [("MatMulQ4", pack_q4_tiles), ("MatMulBF16", pack_bf16_tiles)]
    packed = [pack(rng.standard_normal((k, n)).astype(np.float32)) for _, pack in cases]
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    expected = [_session(llmc_ops, k, n, w, None, False, 1, 1, op=op).run(None, {"x": x})[0]  # type: ignore[attr-defined]
                for (op, _), w in zip(cases, packed, strict=True)]
    sessions = [_session(llmc_ops, k, n, w, None, False, 2, 2, op=op, own_pool=True)
                for (op, _), w in zip(cases, packed, strict=True)]
    wrong: list[str] = []

    def caller(i: int) -> None:
        for _ in range(200):
            if not np.array_equal(sessions[i].run(None, {"x": x})[0], expected[i]):  # type: ignore[attr-defined]
                wrong.append(cases[i][0])

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert wrong == []
