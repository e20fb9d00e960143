"""ONNX Runtime engine over the "inplace" KV layout: the graph (GroupQueryAttention, or Attention + TensorScatter)
writes each step's K/V into buffers that are bound (IOBinding, OrtValue over our own numpy memory) as both past and
present. Nothing copies the cache. With llmc's attention operator the buffers are paged, the default there: every
layer's K and V are pools of blocks [num_blocks, Hkv, block_size, D] shared by all sequences, and the operator writes
each new token into its row's block and reads a row's keys and values where its block table says they are (a cached
prompt prefix in blocks other rows share, too): no gather, no copy; the pools are bound once per session and a prompt's
run binds only its token inputs, the block table and the logits, for exactly the rows asked for, while a decode
step of one token a row binds nothing (`_decode_binding`). The other lowerings
keep a slot of max_len positions per sequence and run windows of consecutive slots (steps.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmc.engines.base import EngineOptions, KVCache, PagedKVCache
from llmc.engines.host_kv import HostKVCache, HostPagedKVCache
from llmc.engines.ort.run import OrtEngineBase
from llmc.engines.steps import StepCore, StepLayout, StepRows
from llmc.errors import EngineError, InputError, ManifestError
from llmc.graph import io_names
from llmc.manifest import KEY_TILE, EngineManifest

_INT32 = frozenset({io_names.SEQLENS_K, io_names.TOTAL_SEQ_LEN, io_names.BLOCK_TABLE, io_names.NEW_TOKENS,
                    io_names.STATE_ROWS})


class OrtInplaceEngine(StepCore, OrtEngineBase):
    def __init__(self, manifest: EngineManifest, directory: Path, options: EngineOptions) -> None:
        super().__init__(manifest, directory, options)
        import onnxruntime as ort

        self._ort = ort
        self._present_names = manifest.kv.names("present")
        self._input_names = [n for n in manifest.decode.input_names()
                             if n not in self._past_names and n not in self._state_names]
        # the states (LFM2's, Qwen3.5's), each a pool [num_slots, ...] the graph reads and writes in place
        if any(not st.pooled for st in manifest.kv.states):
            raise ManifestError("engine.json: an in-place engine's states are pooled (StateSpec.pooled); build the "
                                "engine again with this llmc")
        self._pool_names = list(zip(manifest.kv.state_names("past"), manifest.kv.state_names("present")))
        self._block_size = options.kv_block_size if manifest.kv.paged else 0
        if manifest.kv.key_tiles and self._block_size % KEY_TILE:
            raise InputError(f"--kv-block-size {self._block_size}: this engine holds its keys in groups of {KEY_TILE} "
                             f"positions, so its blocks need at least {KEY_TILE}", "kv_block_size")
        # (session, kv, first, stop) -> an IOBinding with the KV rows (slot memory) or the pools (paged memory, the
        # key's first and stop 0) already bound as past and present, and the OrtValues it holds
        self._bindings: dict[tuple[int, int, int, int], tuple[object, list[object]]] = {}
        # (kv, first, stop) -> the slot window's one-token decode binding with its step inputs and logits bound as
        # well (paged memory: (kv, 0, rows), any rows)
        self._steps: dict[tuple[int, int, int], tuple[object, dict[str, np.ndarray], list[object]]] = {}
        self._logits = np.empty((0, 1, manifest.model.logits_size), np.float32)  # _logits_buffer

    @property
    def kv_block_size(self) -> int:
        return self._block_size

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        self._bindings.clear()
        self._steps.clear()
        if self._block_size:  # paged memory, each slot its own blocks for good
            return HostPagedKVCache.slots(self.manifest.kv, num_slots, min(max_len, self.max_positions),
                                          self._block_size)
        return HostKVCache(self.manifest.kv, num_slots, min(max_len, self.max_positions))

    def new_paged_kv_cache(self, num_slots: int, max_len: int, num_blocks: int) -> PagedKVCache:
        if not self._block_size:
            raise NotImplementedError("this engine keeps the slot layout (built with --no-kv-paged or another "
                                      "attention lowering)")
        self._bindings.clear()  # (keyed by the cache's id, which a new cache may reuse)
        self._steps.clear()
        return HostPagedKVCache(self.manifest.kv, num_slots, max_len, num_blocks, self._block_size)

    def step_layout(self, kv: KVCache) -> StepLayout:
        # slot memory binds a window of consecutive rows, and GroupQueryAttention takes rows after a past with equal
        # numbers of new tokens; paged memory takes any rows through their block tables, and rows of different
        # counts together where the graph has new_tokens (llmc's operators from contract 6 on)
        if isinstance(kv, HostPagedKVCache):
            return StepLayout(window=False, equal_new=io_names.NEW_TOKENS not in self._input_names)
        return StepLayout(window=True, equal_new=True)

    def _binding(self, session: object, kv: HostKVCache | HostPagedKVCache, first: int, stop: int) -> object:
        """An IOBinding over rows first..stop-1 of every KV buffer (OrtValues over contiguous views: no copy), or
        over the whole pools of paged memory, made once; each run only rebinds its token inputs and the logits."""
        key = (id(session), id(kv), first, stop)
        if key not in self._bindings:
            self._bindings[key] = self._kv_binding(session, kv, first, stop)
        return self._bindings[key][0]

    def _kv_binding(self, session: object, kv: HostKVCache | HostPagedKVCache, first: int, stop: int) -> tuple[object, list[object]]:
        binding = session.io_binding()  # type: ignore[attr-defined]
        rows = slice(first, stop) if stop else slice(None)
        values = [self._ort.OrtValue.ortvalue_from_numpy(buf[rows]) for buf in kv.buffers()]
        values += [self._ort.OrtValue.ortvalue_from_numpy(pool) for pool in kv.pooled_states()]  # (whole: by slot)
        for (past, present), value in zip([*zip(self._past_names, self._present_names), *self._pool_names], values):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        return binding, values  # the values stay referenced as long as the binding

    def decode(self, slots: list[int], tokens: list[list[int]], kv: KVCache, *, keep: bool = True) -> np.ndarray:
        """A step of one token a row on paged memory (the usual decode step) goes straight to `_paged_step`; other
        steps through the step core."""
        if not isinstance(kv, HostPagedKVCache) or any(len(t) != 1 for t in tokens):
            return super().decode(slots, tokens, kv, keep=keep)
        kv.check_room(slots, [1] * len(slots))
        logits = self._paged_step(kv, slots, [t[0] for t in tokens])[:, 0]
        for slot in slots:
            kv.lengths[slot] += 1
        return logits.copy() if keep else logits

    def _paged_step(self, kv: HostPagedKVCache, slots: list[int], tokens: list[int]) -> np.ndarray:
        """One token for each of `slots` on paged memory, on the binding made once per batch size
        (`_decode_binding`), its arrays filled in place a row at a time: the inputs `_feeds` would give, without
        building them as arrays first. Right after a step, whose ~100 MB of weights evict the interpreter's code and
        data from the caches, each numpy array operation costs ~5-40 us: building the feeds took 0.16 ms of a batch-1
        step on the EPYC VM, this 0.07. Returns the bound logits [B, 1, V] (the engine's buffer)."""
        binding, step = self._decode_binding(kv, 0, len(slots), True)
        ids, pos, seqlens_k, state_rows = (step.get(name) for name in (
            io_names.INPUT_IDS, io_names.POSITION_IDS, io_names.SEQLENS_K, io_names.STATE_ROWS))
        assert ids is not None
        longest = 0
        for b, (slot, token) in enumerate(zip(slots, tokens)):
            cached = int(kv.lengths[slot])  # the new token's position; seqlens_k is cached + new - 1: the same
            ids[b, 0] = token
            if pos is not None:
                pos[b, 0] = cached
            if seqlens_k is not None:
                seqlens_k[b] = cached
            if state_rows is not None:
                state_rows[b] = slot
            longest = max(longest, cached + 1)
        if seqlens_k is not None:
            step[io_names.TOTAL_SEQ_LEN][...] = longest
        kv.block_table(slots, step[io_names.BLOCK_TABLE])  # (new_tokens: bound as ones)
        self._execute(self._decode, binding)
        return step[io_names.LOGITS]

    def _feeds(self, kv: KVCache, rows: StepRows) -> dict[str, np.ndarray]:
        """The graph's token inputs for `rows` (only those it has: a step computes nothing it does not feed), in
        their natural integer types (`_INT32` are int32 in the graph)."""
        need, feeds = self._input_names, {io_names.INPUT_IDS: rows.ids}
        seqlens = rows.seqlens
        if io_names.POSITION_IDS in need:
            feeds[io_names.POSITION_IDS] = rows.positions
        if io_names.SEQLENS_K in need:
            feeds[io_names.SEQLENS_K] = seqlens - 1  # cached + new - 1
            feeds[io_names.TOTAL_SEQ_LEN] = seqlens.max()
        if io_names.BLOCK_TABLE in need:
            assert isinstance(kv, HostPagedKVCache)
            feeds[io_names.BLOCK_TABLE] = kv.block_table(rows.slots)
        if io_names.NEW_TOKENS in need:
            counts = rows.counts
            if rows.live is not None and self._pool_names:  # (a window's dummy rows: none, so that their states
                # stay as they are)
                counts = np.zeros_like(counts)
                counts[rows.live] = rows.counts[rows.live]
            feeds[io_names.NEW_TOKENS] = counts
        if io_names.STATE_ROWS in need:
            feeds[io_names.STATE_ROWS] = np.asarray(rows.slots, np.int32)
        return feeds

    def _logits_buffer(self, batch: int, rows: int) -> np.ndarray:
        """A one-row logits output buffer for `batch` rows: the first rows of one kept buffer, grown to the largest
        batch seen (the core copies what it keeps), so a decode step of 8 rows allocates no fresh 1.5 MB (and its
        page faults), and batches of every size share one buffer."""
        if rows != 1:
            return np.empty((batch, rows, self.logits_size), np.float32)
        if self._logits.shape[0] < batch:
            self._logits = np.empty((batch, 1, self.logits_size), np.float32)
        return self._logits[:batch]  # contiguous: the leading rows of a C-ordered array

    def _run(self, graph: str, kv: KVCache, rows: StepRows) -> np.ndarray:
        assert isinstance(kv, HostKVCache | HostPagedKVCache)
        session = self._decode if graph == "decode" else self._prefill
        paged = isinstance(kv, HostPagedKVCache)
        batch = len(rows.slots)
        if graph == "decode" and rows.ids.shape[1] == 1:
            if isinstance(kv, HostPagedKVCache):
                return self._paged_step(kv, rows.slots, rows.ids[:, 0].tolist())
            binding, step = self._decode_binding(kv, rows.first, rows.first + batch, False)
            for name, array in self._feeds(kv, rows).items():
                step[name][...] = array
            logits = step[io_names.LOGITS]
        else:
            binding = self._binding(session, kv, *((0, 0) if paged else (rows.first, rows.first + batch)))
            for name, array in self._feeds(kv, rows).items():
                binding.bind_cpu_input(name, np.asarray(array, np.int32 if name in _INT32 else np.int64))  # type: ignore[attr-defined]
            logits = self._logits_buffer(batch, rows.logits_rows)
            binding.bind_output(io_names.LOGITS, "cpu", 0, np.float32,  # type: ignore[attr-defined]
                                list(logits.shape), logits.ctypes.data)
            if graph == "prefill" and self._pool_names:
                kv.reset_states(rows.slots)  # (a prompt's states start from zeros, in place)
        self._execute(session, binding)
        return logits

    @staticmethod
    def _execute(session: object, binding: object) -> None:
        try:
            session.run_with_iobinding(binding)  # type: ignore[attr-defined]
        except Exception as e:
            raise EngineError(f"onnxruntime failed: {str(e).splitlines()[0]}") from e

    def _decode_binding(self, kv: HostKVCache | HostPagedKVCache, first: int, stop: int,
                        paged: bool) -> tuple[object, dict[str, np.ndarray]]:
        """The one-token decode binding for rows first..stop-1 (paged memory: for any stop - first rows) with its
        inputs and logits bound once, to arrays that each step fills in place: a step binds nothing. (Each
        binding call and fresh array of a step cost ~5-40 us there: after a step's ~100 MB of weights, the
        interpreter's and numpy's code and data come from memory.)"""
        batch = stop - first
        key = (id(kv), 0, batch) if paged else (id(kv), first, stop)
        if key not in self._steps:
            # its own KV binding (chunks rebind theirs); paged: the whole pools
            binding, kv_values = self._kv_binding(self._decode, kv, *((0, 0) if paged else (first, stop)))
            arrays: dict[str, np.ndarray] = {
                io_names.INPUT_IDS: np.zeros((batch, 1), np.int64),
                io_names.POSITION_IDS: np.zeros((batch, 1), np.int64),
                io_names.SEQLENS_K: np.zeros(batch, np.int32), io_names.TOTAL_SEQ_LEN: np.zeros((), np.int32),
                io_names.NEW_TOKENS: np.ones(batch, np.int32),
                io_names.LOGITS: np.zeros((batch, 1, self.logits_size), np.float32),
                io_names.STATE_ROWS: np.zeros(batch, np.int32)}
            if paged:  # as wide as any row's table can be: the operator reads only the blocks a row has
                assert isinstance(kv, HostPagedKVCache)
                arrays[io_names.BLOCK_TABLE] = np.zeros((batch, -(-kv.max_len // kv.block_size)), np.int32)
            arrays = {name: a for name, a in arrays.items() if name in self._input_names or name == io_names.LOGITS}
            values = {name: self._ort.OrtValue.ortvalue_from_numpy(a) for name, a in arrays.items()}
            for name, value in values.items():
                if name == io_names.LOGITS:
                    binding.bind_ortvalue_output(name, value)  # type: ignore[attr-defined]
                else:
                    binding.bind_ortvalue_input(name, value)  # type: ignore[attr-defined]
            self._steps[key] = (binding, arrays, [*kv_values, *values.values()])
        binding, arrays, _ = self._steps[key]
        return binding, arrays
