"""Host KV memory: allocated lazily (the kernel maps a page when it is first written), or mapped whole at once by
`prefault` (a server at start-up: RuntimeConfig.kv_prefault, on by default for `llmc serve`)."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import numpy as np
import pytest
from conftest import Built

from llmc.engines.host_kv import HostKVCache, HostPagedKVCache
from llmc.manifest import KVSpec
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.generator import EngineLoop

# 2 layers x K and V, 48 MiB each
SPEC = KVSpec("inplace", "float16", num_layers=2, num_kv_heads=4, head_dim=64, past_key="pk.{i}",
              past_value="pv.{i}", present_key="k.{i}", present_value="v.{i}", paged=True)
BLOCKS, BLOCK_SIZE = 6144, 16  # 6144 x 4 x 16 x 64 x 2 bytes = 48 MiB a buffer


LIBC = ctypes.CDLL(None, use_errno=True)  # Linux (llmc's platform: README): mincore(2), madvise(2)
LIBC.mincore.argtypes = LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED = 4


def _pages(buf: np.ndarray) -> tuple[int, int]:
    """The whole pages inside buf: (first address, length)."""
    start = -(-buf.ctypes.data // PAGE) * PAGE
    return start, (buf.ctypes.data + buf.nbytes) // PAGE * PAGE - start


def resident_mib(buffers: list[np.ndarray]) -> float:
    """MiB of these buffers' pages mapped in memory (mincore(2): the buffers' own pages, whatever else the process
    allocates or frees meanwhile)."""
    total = 0
    for buf in buffers:
        start, length = _pages(buf)
        vec = np.zeros(length // PAGE, np.uint8)
        if LIBC.mincore(start, length, vec.ctypes.data):
            raise OSError(ctypes.get_errno(), "mincore")
        total += int(np.count_nonzero(vec & 1)) * PAGE
    return total / 2**20


def unmap(buffers: list[np.ndarray]) -> None:
    """Drop the buffers' pages (they read as zeros again): the allocator may have handed out memory that some earlier
    test in this process wrote, which is mapped already."""
    for buf in buffers:
        start, length = _pages(buf)
        if LIBC.madvise(start, length, MADV_DONTNEED):
            raise OSError(ctypes.get_errno(), "madvise")


@pytest.mark.parametrize("kind", ["paged", "slots"])
def test_prefault_maps_every_page_and_a_lazy_cache_maps_none(kind: str) -> None:
    if kind == "paged":
        kv: Any = HostPagedKVCache(SPEC, num_slots=4, max_len=1024, num_blocks=BLOCKS, block_size=BLOCK_SIZE)
    else:  # the slot layout: [slots, Hkv, max_len, D]
        kv = HostKVCache(SPEC, num_slots=6, max_len=BLOCKS * BLOCK_SIZE // 6)
    mib = kv.nbytes / 2**20
    assert mib == pytest.approx(192)
    unmap(kv.buffers())
    lazy = resident_mib(kv.buffers())
    assert lazy < 0.1 * mib, f"{lazy:.0f} MiB resident of {mib:.0f} before any write"

    assert kv.prefault(threads=2) == kv.nbytes
    mapped = resident_mib(kv.buffers())
    assert mapped > 0.95 * mib, f"{mapped:.0f} MiB resident of {mib:.0f} after prefault"
    assert all(not buf.any() for buf in kv.buffers())  # still zeros: nothing but the mapping changed


def test_the_loop_prefaults_its_kv_memory_only_when_asked(monkeypatch: pytest.MonkeyPatch, tiny_llama: Built,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from llmc.engines.base import EngineOptions
    from llmc.engines.registry import load_engine_dir

    calls: list[tuple[int, int]] = []
    real = HostPagedKVCache.prefault

    def spy(self: HostPagedKVCache, threads: int = 1) -> int:
        calls.append((threads, real(self, threads)))
        return calls[-1][1]

    monkeypatch.setattr(HostPagedKVCache, "prefault", spy)
    engine = load_engine_dir(tiny_llama.engine_dir, EngineOptions(threads=2))
    loop = EngineLoop(engine, None, RuntimeConfig(kv_budget_mb=8))
    assert calls == [] and isinstance(loop.kv, HostPagedKVCache)
    with caplog.at_level(logging.INFO, logger="llmc.runtime"):
        loop = EngineLoop(engine, None, RuntimeConfig(kv_budget_mb=8, kv_prefault=True))
    assert calls == [(2, loop.kv.nbytes)] and loop.kv.nbytes > 7 * 2**20
    assert f"KV memory: {loop.kv.nbytes / 2**20:.0f} MB mapped at start-up" in caplog.text  # what an operator sees
    assert np.all([not buf.any() for buf in loop.kv.buffers()])


@pytest.mark.parametrize("paged", [False, True])
def test_kv_memory_past_the_machine_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, paged: bool) -> None:
    """`--kv-budget-mb 99999999999` gave numpy's MemoryError traceback (or, under the overcommit limit, a
    budget no page of which could ever be mapped): refused naming the flag and both sizes."""
    from llmc.engines import host_kv
    from llmc.errors import InputError

    assert host_kv.memory_limit() > 2**28  # the machine's (or its cgroup's) RAM, not a made-up figure
    monkeypatch.setattr(host_kv, "memory_limit", lambda: 150 * 2**20)  # two 48 MiB buffers a layer: 192 MiB
    with pytest.raises(InputError, match=r"--kv-budget-mb asks for 192 MiB .* machine's 150 MiB") as err:
        HostPagedKVCache(SPEC, 4, 1024, BLOCKS, BLOCK_SIZE) if paged else HostKVCache(SPEC, 6, BLOCKS * 16 // 6)
    assert err.value.param == "kv_budget_mb"
    monkeypatch.setattr(host_kv, "memory_limit", lambda: 200 * 2**20)
    assert HostPagedKVCache(SPEC, 4, 1024, BLOCKS, BLOCK_SIZE).nbytes == 192 * 2**20
