"""ONNX Runtime engine over the "inplace" KV layout: the graph (GroupQueryAttention, or Attention + TensorScatter)
writes each step's K/V into buffers that are bound (IOBinding, OrtValue over our own numpy memory) as both past and
present. Nothing copies the cache. With llmc's attention operator the buffers are paged (paged.py: block pools and
block tables, the default there); the other lowerings keep a slot of max_len positions per sequence.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llmc.engines.base import EngineOptions, KVCache
from llmc.engines.host_kv import HostKVCache, HostPagedKVCache
from llmc.engines.ort.paged import PagedRuns
from llmc.engines.ort.run import OrtEngineBase
from llmc.errors import EngineError, LimitError
from llmc.graph import io_names
from llmc.manifest import EngineManifest


class OrtInplaceEngine(PagedRuns, OrtEngineBase):
    def __init__(self, manifest: EngineManifest, directory: Path, options: EngineOptions) -> None:
        super().__init__(manifest, directory, options)
        import onnxruntime as ort

        self._ort = ort
        self._present_names = manifest.kv.names("present")
        self._input_names = [n for n in manifest.decode.input_names() if n not in self._past_names]
        # (session, kv, first, stop) -> an IOBinding with the KV rows already bound as past and present
        self._bindings: dict[tuple[int, int, int, int], tuple[object, list[object]]] = {}
        # (kv, first, stop) -> the decode binding above with its step inputs and logits bound as well
        self._steps: dict[tuple[int, int, int], tuple[object, dict[str, np.ndarray], list[object]]] = {}
        self._block_size = options.kv_block_size if manifest.kv.paged else 0  # PagedRuns
        self._pool_bindings = {}

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        self._bindings.clear()
        self._steps.clear()
        self._pool_bindings.clear()
        if self._block_size:  # paged memory, each slot its own blocks for good
            return HostPagedKVCache.slots(self.manifest.kv, num_slots, min(max_len, self.max_positions),
                                          self._block_size)
        return HostKVCache(self.manifest.kv, num_slots, min(max_len, self.max_positions))

    def _binding(self, session: object, kv: HostKVCache, first: int, stop: int) -> object:
        """An IOBinding over rows first..stop-1 of every KV buffer (OrtValues over contiguous views: no copy),
        made once per row range; each run only rebinds the token inputs and the logits."""
        key = (id(session), id(kv), first, stop)
        if key not in self._bindings:
            self._bindings[key] = self._kv_binding(session, kv, first, stop)
        return self._bindings[key][0]

    def _kv_binding(self, session: object, kv: HostKVCache, first: int, stop: int) -> tuple[object, list[object]]:
        binding = session.io_binding()  # type: ignore[attr-defined]
        values = [self._ort.OrtValue.ortvalue_from_numpy(buf[first:stop]) for buf in kv.buffers()]
        for past, present, value in zip(self._past_names, self._present_names, values):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        return binding, values  # the values stay referenced as long as the binding

    def _feeds(self, ids: np.ndarray, start: np.ndarray, counts: np.ndarray) -> dict[str, np.ndarray]:
        """Inputs for rows with start[b] cached tokens and counts[b] new ones (right-padded to ids.shape[1])."""
        width = ids.shape[1]
        seqlens = start + counts
        pos = start[:, None] + np.arange(width)[None, :]
        pos[np.arange(width)[None, :] >= counts[:, None]] = 0  # pads: position 0 (in range, never the max)
        feeds = {io_names.INPUT_IDS: ids, io_names.POSITION_IDS: pos.astype(np.int64),
                 io_names.SEQLENS_K: (seqlens - 1).astype(np.int32),
                 io_names.TOTAL_SEQ_LEN: np.array(int(seqlens.max()), dtype=np.int32)}
        return {name: feeds[name] for name in self._input_names}

    def _run_rows(self, session: object, kv: HostKVCache, first: int, ids: np.ndarray, start: np.ndarray,
                  counts: np.ndarray, logits_rows: int) -> np.ndarray:
        """Run rows first..first+B-1 of the cache, each with start[b] cached and counts[b] new tokens."""
        batch = ids.shape[0]
        binding = self._binding(session, kv, first, first + batch)
        for name, array in self._feeds(ids, start, counts).items():
            binding.bind_cpu_input(name, array)  # type: ignore[attr-defined]
        logits = np.empty((batch, logits_rows, self.vocab_size), np.float32)
        binding.bind_output(io_names.LOGITS, "cpu", 0, np.float32, list(logits.shape),  # type: ignore[attr-defined]
                            logits.ctypes.data)
        try:
            session.run_with_iobinding(binding)  # type: ignore[attr-defined]
        except Exception as e:
            raise EngineError(f"onnxruntime failed: {str(e).splitlines()[0]}") from e
        return logits

    def prefill(self, slots: list[int], prompts: list[list[int]], kv: KVCache) -> np.ndarray:
        if isinstance(kv, HostPagedKVCache):
            return self._paged_prefill(slots, prompts, kv)
        assert isinstance(kv, HostKVCache)
        lens = np.array([len(p) for p in prompts], np.int64)
        kv.check_room(slots, lens.tolist())
        if slots != list(range(slots[0], slots[0] + len(slots))):  # prompts write rows in place: one run per row
            return np.concatenate([self.prefill([s], [p], kv) for s, p in zip(slots, prompts)])
        ids = np.zeros((len(prompts), int(lens.max())), np.int64)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = p
        logits = self._run_rows(self._prefill, kv, slots[0], ids, np.zeros_like(lens), lens, 1)
        kv.lengths[slots] = lens
        return logits[:, 0, :]

    def decode(self, slots: list[int], tokens: list[list[int]], kv: KVCache) -> np.ndarray:
        if isinstance(kv, HostPagedKVCache):
            return self._paged_decode(slots, tokens, kv)
        assert isinstance(kv, HostKVCache)
        if any(len(t) != 1 for t in tokens):  # prompt chunks: GQA wants equal new lengths, so one run per row
            kv.check_room(slots, [len(t) for t in tokens])
            return np.concatenate([self._extend(s, t, kv) for s, t in zip(slots, tokens)])
        first, stop = min(slots), max(slots) + 1
        # Rows of the range that are not in this step (mid-prompt) run a harmless dummy token: it is written at
        # their current length, which their next real token overwrites. One check covers every row of the range.
        start = kv.lengths[first:stop]
        if np.any(start + 1 > kv.max_len):
            raise LimitError(f"a KV slot in rows {first}..{stop - 1} is full ({kv.max_len} tokens)")
        binding, step = self._decode_binding(kv, first, stop)
        rows = np.array(slots) - first
        ids = np.zeros(stop - first, np.int64)
        ids[rows] = [t[0] for t in tokens]
        now = {io_names.INPUT_IDS: ids[:, None], io_names.POSITION_IDS: start[:, None],
               io_names.SEQLENS_K: start, io_names.TOTAL_SEQ_LEN: start.max() + 1}  # seqlens_k: cached + 1 new - 1
        for name, array in step.items():
            if name != io_names.LOGITS:
                array[...] = now[name]
        try:
            self._decode.run_with_iobinding(binding)  # type: ignore[attr-defined]
        except Exception as e:
            raise EngineError(f"onnxruntime failed: {str(e).splitlines()[0]}") from e
        kv.lengths[slots] += 1
        return step[io_names.LOGITS][rows, 0, :]  # a copy: the buffer is the next step's output

    def _decode_binding(self, kv: HostKVCache, first: int, stop: int) -> tuple[object, dict[str, np.ndarray]]:
        """The one-token decode binding for rows first..stop-1 with its inputs and logits bound once, to arrays
        that each step fills in place: a step binds nothing."""
        key = (id(kv), first, stop)
        if key not in self._steps:
            batch = stop - first
            binding, kv_values = self._kv_binding(self._decode, kv, first, stop)  # its own: _extend rebinds
            arrays: dict[str, np.ndarray] = {
                io_names.INPUT_IDS: np.zeros((batch, 1), np.int64),
                io_names.POSITION_IDS: np.zeros((batch, 1), np.int64),
                io_names.SEQLENS_K: np.zeros(batch, np.int32), io_names.TOTAL_SEQ_LEN: np.zeros((), np.int32),
                io_names.LOGITS: np.zeros((batch, 1, self.vocab_size), np.float32)}
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

    def _extend(self, slot: int, toks: list[int], kv: HostKVCache) -> np.ndarray:
        start, counts = kv.lengths[slot : slot + 1].copy(), np.array([len(toks)], np.int64)
        rows = len(toks) if self.manifest.decode.logits == "all" else 1
        logits = self._run_rows(self._decode, kv, slot, np.array([toks], np.int64), start, counts, rows)
        kv.lengths[slot] += len(toks)
        return logits[:, -1, :]
