"""The in-place ONNX Runtime engine over paged KV memory (KVSpec.paged: llmc's attention operator with a block table).

Every layer's K and V are pools of blocks [num_blocks, Hkv, block_size, D] shared by all sequences; the operator
writes each new token into its row's block and reads a row's keys and values where its block table says they are
(a cached prompt prefix in blocks other rows share, too): no gather, no copy. The pools are bound once per session
as past and present; a run binds only its token inputs, the block table and the logits, and runs exactly the rows
asked for (no batch of contiguous slots is needed).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.engines.base import PagedKVCache
from llmc.engines.host_kv import HostPagedKVCache
from llmc.errors import EngineError
from llmc.graph import io_names
from llmc.manifest import EngineManifest


class PagedRuns:
    """Mixed into OrtInplaceEngine: prefill and decode over a HostPagedKVCache."""

    manifest: EngineManifest
    _ort: Any
    _prefill: Any
    _decode: Any
    _past_names: list[str]
    _present_names: list[str]
    _input_names: list[str]
    _block_size: int
    _pool_bindings: dict[tuple[int, int], tuple[Any, list[Any]]]

    @property
    def kv_block_size(self) -> int:
        return self._block_size

    def new_paged_kv_cache(self, num_slots: int, max_len: int, num_blocks: int) -> PagedKVCache:
        if not self._block_size:
            raise NotImplementedError("this engine keeps the slot layout (built with --no-kv-paged or another "
                                      "attention lowering)")
        self._pool_bindings.clear()
        return HostPagedKVCache(self.manifest.kv, num_slots, max_len, num_blocks, self._block_size)

    def _pools(self, session: Any, kv: HostPagedKVCache) -> Any:
        """An IOBinding with every pool bound as its layer's past and present (OrtValues over our memory), once."""
        key = (id(session), id(kv))
        if key not in self._pool_bindings:
            binding = session.io_binding()
            values = [self._ort.OrtValue.ortvalue_from_numpy(buf) for buf in kv.buffers()]
            for past, present, value in zip(self._past_names, self._present_names, values):
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
            self._pool_bindings[key] = (binding, values)
        return self._pool_bindings[key][0]

    def _run_paged(self, session: Any, kv: HostPagedKVCache, slots: list[int], ids: np.ndarray, start: np.ndarray,
                   counts: np.ndarray, total: int, logits_rows: int) -> np.ndarray:
        """Rows `slots`, each with start[b] cached and counts[b] new tokens (right-padded to ids.shape[1])."""
        width = ids.shape[1]
        pos = start[:, None] + np.arange(width)[None, :]
        pos[np.arange(width)[None, :] >= counts[:, None]] = 0  # pads: position 0 (in range, never the max)
        feeds = {io_names.INPUT_IDS: ids, io_names.POSITION_IDS: pos.astype(np.int64),
                 io_names.SEQLENS_K: (start + counts - 1).astype(np.int32),
                 io_names.TOTAL_SEQ_LEN: np.array(total, np.int32), io_names.BLOCK_TABLE: kv.block_table(slots)}
        binding = self._pools(session, kv)
        for name in self._input_names:
            binding.bind_cpu_input(name, feeds[name])
        logits = np.empty((len(slots), logits_rows, self.manifest.model.vocab_size), np.float32)
        binding.bind_output(io_names.LOGITS, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        try:
            session.run_with_iobinding(binding)
        except Exception as e:
            raise EngineError(f"onnxruntime failed: {str(e).splitlines()[0]}") from e
        return logits

    def _paged_prefill(self, slots: list[int], prompts: list[list[int]], kv: HostPagedKVCache) -> np.ndarray:
        lens = np.array([len(p) for p in prompts], np.int64)
        kv.check_room(slots, lens.tolist())
        ids = np.zeros((len(prompts), int(lens.max())), np.int64)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = p
        # total == S: the operator's first-prompt form (right-padded rows, no past)
        logits = self._run_paged(self._prefill, kv, slots, ids, np.zeros_like(lens), lens, ids.shape[1], 1)
        kv.lengths[slots] = lens
        return logits[:, 0, :]

    def _paged_decode(self, slots: list[int], tokens: list[list[int]], kv: HostPagedKVCache) -> np.ndarray:
        kv.check_room(slots, [len(t) for t in tokens])
        # rows after a past take the same number of new tokens in one run (the operator's form): one run per length
        # (decode rows all at once; prompt chunks of equal length, e.g. questions after a cached prefix, together)
        by_len: dict[int, list[int]] = {}
        for row, t in enumerate(tokens):
            by_len.setdefault(len(t), []).append(row)
        out = np.empty((len(slots), self.manifest.model.vocab_size), np.float32)
        for rows in by_len.values():
            out[rows] = self._paged_extend([slots[r] for r in rows], [tokens[r] for r in rows], kv)
        return out

    def _paged_extend(self, slots: list[int], toks: list[list[int]], kv: HostPagedKVCache) -> np.ndarray:
        """Rows of equal new lengths S after their cached tokens: logits after each row's last."""
        start, n = kv.lengths[slots].copy(), len(toks[0])
        logit_rows = n if self.manifest.decode.logits == "all" else 1
        logits = self._run_paged(self._decode, kv, slots, np.array(toks, np.int64), start,
                                 np.full(len(slots), n, np.int64), int(start.max()) + n, logit_rows)
        kv.lengths[slots] += n
        return logits[:, -1, :]
