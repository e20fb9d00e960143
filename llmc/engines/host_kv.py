"""KV memory in host RAM (numpy), for CPU backends."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from llmc.engines.base import KVCache, PagedKVCache
from llmc.errors import InputError
from llmc.manifest import KVSpec


def memory_limit() -> int:
    """Bytes of RAM this process may use: the machine's, or its cgroup's limit where that is lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


class _HostBuffers:
    """One K and one V numpy buffer per layer (slots or block pools) in host RAM, and each slot's states
    (KVSpec.states: a conv layer's last inputs, a Gated DeltaNet's recurrent state) [num_slots, *shape] per state
    tensor: pooled ones are bound whole and written in place by the graph (the in-place engines), the others taken in
    and given back by rows (the concat engine)."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    states: list[np.ndarray]

    def _allocate(self, spec: KVSpec, lead: int, length: int) -> None:
        """Zeroed K and V buffers per layer, [lead, its KV heads, length, its row] (KVSpec.buffer_shape); memory
        past what this machine has is refused by name (numpy's zeros are mapped lazily, so an oversized budget would
        otherwise fail at its first touch)."""
        dtype = np.dtype({"float16": np.float16, "int8": np.int8}.get(spec.dtype, np.float32))
        shapes = [spec.buffer_shape(j, lead, length) for j in range(spec.num_layers)]
        need, limit = 2 * sum(int(np.prod(s)) for s in shapes) * dtype.itemsize, memory_limit()
        if need > limit:
            raise InputError(f"--kv-budget-mb asks for {need / 2**20:,.0f} MiB of KV memory, more than this "
                             f"machine's {limit / 2**20:,.0f} MiB: lower it", "kv_budget_mb")
        try:
            self.keys = [np.zeros(shape, dtype) for shape in shapes]
            self.values = [np.zeros(shape, dtype) for shape in shapes]
            self.states = [np.zeros((self.num_slots, *s.shape), np.float32) for s in spec.states for _ in range(s.count)]
            pooled = [s.pooled for s in spec.states for _ in range(s.count)]
            self._copied = [s for s, p in zip(self.states, pooled) if not p]  # (made once: a step reads them)
            self._pooled = [s for s, p in zip(self.states, pooled) if p]
        except MemoryError:
            raise InputError(f"--kv-budget-mb: {need / 2**20:,.0f} MiB of KV memory could not be allocated "
                             f"(this machine has {limit / 2**20:,.0f} MiB): lower it", "kv_budget_mb") from None

    num_slots: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values, *self.states))

    def copied_states(self) -> list[np.ndarray]:
        """The states a run takes in and gives out by rows (not pooled: StateSpec.pooled), in KVSpec order."""
        return self._copied

    def pooled_states(self) -> list[np.ndarray]:
        """The states a graph reads and writes in place, whole pools [num_slots, *shape], in KVSpec order."""
        return self._pooled

    def state_rows(self, slots: list[int]) -> list[np.ndarray]:
        """Each copied state's rows for `slots` [B, *shape]."""
        return [s[slots] for s in self._copied]

    def store_states(self, slots: list[int], present: list[np.ndarray]) -> None:
        """Write each copied state's rows after a run back to `slots`."""
        for buf, new in zip(self._copied, present):
            buf[slots] = new

    def reset_states(self, slots: list[int]) -> None:
        """Zero the pooled states of `slots` (prompts about to start there)."""
        for buf in self._pooled:
            buf[slots] = 0

    def _move_states(self, src: int, dst: int) -> None:
        for buf in self.states:
            buf[dst] = buf[src]

    def buffers(self) -> list[np.ndarray]:
        """K and V buffers interleaved by layer, in the order of KVSpec.names()."""
        return [buf for pair in zip(self.keys, self.values) for buf in pair]

    def prefault(self, threads: int = 1) -> int:
        """Write zeros over every buffer (they are zeros already: np.zeros maps pages lazily), so the kernel maps
        them now. Left lazy, the first write of each page lands inside a decode step: on a VM that backs its
        memory on first touch, 3-5 s a GiB, 50-75 ms stalls between tokens (docs/kv_cache.md).
        ndarray.fill lets go of the GIL: the buffers go over `threads` threads."""
        buffers = self.keys + self.values + self.states
        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(lambda buf: buf.fill(0), buffers))
        return sum(buf.nbytes for buf in buffers)


class HostKVCache(_HostBuffers, KVCache):
    """Per layer one K and one V buffer [num_slots, Hkv, max_len, D], allocated once."""

    def __init__(self, spec: KVSpec, num_slots: int, max_len: int) -> None:
        super().__init__(num_slots, max_len)
        # keys[l], values[l]: [slots, Hkv, max_len, D] (int8: D + 4, each row's scale after its values)
        self._allocate(spec, num_slots, max_len)

    def move(self, src: int, dst: int) -> None:
        n = int(self.lengths[src])
        for buf in self.buffers():
            buf[dst, :, :n] = buf[src, :, :n]
        self._move_states(src, dst)
        self.lengths[dst], self.lengths[src] = n, 0

    def write(self, slot: int, start: int, present: list[np.ndarray], row: int, src: slice) -> None:
        """Copy positions `src` of batch row `row` of each present tensor into `slot` at `start`."""
        n = src.stop - src.start
        for buf, new in zip(self.buffers(), present):
            buf[slot, :, start:start + n] = new[row, :, src]

    def gather(self, slots: list[int], past_len: int) -> list[np.ndarray]:
        """[B, Hkv, P, D] views (contiguous slots) or copies of the first past_len positions of each slot."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            rows = slice(slots[0], slots[0] + len(slots))
            return [buf[rows, :, :past_len] for buf in self.buffers()]
        return [buf[slots][:, :, :past_len] for buf in self.buffers()]


class HostPagedKVCache(_HostBuffers, PagedKVCache):
    """Per layer one K and one V pool [num_blocks, Hkv, block_size, D] (int8: D + scales), allocated once and
    shared by all slots through their block tables.

    `fixed` (HostPagedKVCache.slots): slot s owns blocks [s * M, (s + 1) * M) for good, M = ceil(max_len /
    block_size): the slot interface over paged memory, for callers without a block manager."""

    def __init__(self, spec: KVSpec, num_slots: int, max_len: int, num_blocks: int, block_size: int,
                 fixed: bool = False) -> None:
        super().__init__(num_slots, max_len, num_blocks, block_size)
        self._allocate(spec, num_blocks, block_size)
        self.fixed = fixed
        if fixed:
            per = num_blocks // num_slots
            self.tables = [list(range(s * per, (s + 1) * per)) for s in range(num_slots)]

    @classmethod
    def slots(cls, spec: KVSpec, num_slots: int, max_len: int, block_size: int) -> HostPagedKVCache:
        return cls(spec, num_slots, max_len, num_slots * -(-max_len // block_size), block_size, fixed=True)

    def move(self, src: int, dst: int) -> None:
        self._move_states(src, dst)
        if not self.fixed:
            super().move(src, dst)
            return
        self.tables[dst], self.tables[src] = self.tables[src], self.tables[dst]  # dst's blocks are free: src's now
        self.lengths[dst], self.lengths[src] = self.lengths[src], 0

    def free(self, slot: int) -> None:
        if self.fixed:
            self.lengths[slot] = 0
        else:
            super().free(slot)

    def block_table(self, slots: list[int], out: np.ndarray | None = None) -> np.ndarray:
        """[B, max blocks of the rows] int32, each row's table zero-padded (the operator reads only its blocks);
        or written into `out` [B, ceil(max_len / block_size)] (a bound array: only its rows' used columns change;
        a block reserved past max_len, never read, is left out)."""
        if out is None:
            out = np.zeros((len(slots), max(1, max(len(self.tables[s]) for s in slots))), np.int32)
        width = out.shape[1]
        for row, slot in enumerate(slots):
            blocks = self.tables[slot]
            out[row, : len(blocks)] = blocks if len(blocks) <= width else blocks[:width]
        return out
