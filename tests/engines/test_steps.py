"""The step core (llmc/engines/steps.py) with plain values: which runs each layout makes, what each run is given,
and which logits come back. The engines over real graphs are checked against transformers elsewhere
(tests/export/test_parity.py, tests/engines/test_paged_engine.py, tests/trt/test_lower.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from runtime.fake_engine import fake_manifest

from llmc.engines.base import KVCache
from llmc.engines.host_kv import HostKVCache
from llmc.engines.steps import StepCore, StepLayout, StepRows, padded_groups, runs, windows
from llmc.errors import LimitError


def test_runs_of_consecutive_slots() -> None:
    assert runs([0, 1, 2], 8) == [[0, 1, 2]]
    assert runs([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4]]
    assert runs([3, 4, 0, 1, 7], 8) == [[0, 1], [2, 3], [4]]
    assert runs([0, 1, 2, 3], 0) == [[0, 1, 2, 3]]


def test_windows_cover_every_slot_from_the_lowest() -> None:
    assert windows([4, 0, 1], 2) == [(0, 2, [1, 2]), (4, 5, [0])]
    assert windows([5, 0, 3], 0) == [(0, 6, [1, 2, 0])]
    assert windows([7, 1, 2, 3], 2) == [(1, 3, [1, 2]), (3, 4, [3]), (7, 8, [0])]


def test_padded_groups_keep_decode_rows_out_of_long_chunks() -> None:
    assert padded_groups([1, 1, 1]) == [[0, 1, 2]]
    assert padded_groups([1, 128, 1, 100]) == [[1, 3], [0, 2]]  # 128 and 100: 28 <= 32 pads; decode rows apart
    assert padded_groups([15, 13, 17, 1, 14]) == [[2, 0, 4, 1], [3]]
    assert padded_groups([40, 20, 1]) == [[0], [1], [2]]  # 20 pads > max(8, 10); 19 > max(8, 5)
    assert padded_groups([9, 1]) == [[0, 1]]  # 8 pads: within the floor


def test_positions_pad_with_zero_and_seqlens() -> None:
    rows = StepRows([0, 1], np.array([[5, 6, 7], [8, 0, 0]]), np.array([0, 4]), np.array([3, 1]), 1)
    assert rows.positions.tolist() == [[0, 1, 2], [4, 0, 0]] and rows.seqlens.tolist() == [3, 5]


class Recording(StepCore):
    """The core over a `_run` that records each run; logits[b, r] = 100 * slot + r (which row, which position)."""

    def __init__(self, layout: StepLayout, logits: str = "all") -> None:
        base = fake_manifest(vocab_size=4)
        self.manifest = replace(base, decode=replace(base.decode, logits=logits))
        self.layout = layout
        self.calls: list[tuple[str, list[int], list[list[int]], list[int], list[int], int]] = []

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        return HostKVCache(self.manifest.kv, num_slots, max_len)

    def step_layout(self, kv: KVCache) -> StepLayout:
        return self.layout

    def _run(self, graph: str, kv: KVCache, rows: StepRows) -> np.ndarray:
        self.calls.append((graph, rows.slots, rows.ids.tolist(), rows.start.tolist(), rows.counts.tolist(),
                           rows.logits_rows))
        value = 100.0 * np.array(rows.slots)[:, None] + np.arange(rows.logits_rows)[None, :]
        return np.repeat(value[:, :, None], self.vocab_size, axis=2).astype(np.float32)


def test_any_rows_mixed_counts_run_together_and_each_rows_last_logits() -> None:
    core = Recording(StepLayout(window=False, equal_new=False))
    kv = core.new_kv_cache(6, 64)
    out = core.prefill([5, 2], [[1, 2, 3], [4]], kv)
    assert core.calls == [("prefill", [5, 2], [[1, 2, 3], [4, 0, 0]], [0, 0], [3, 1], 1)]
    assert out[:, 0].tolist() == [500.0, 200.0] and kv.lengths[[5, 2]].tolist() == [3, 1]
    core.calls.clear()
    out = core.decode([2, 5], [[7, 8], [9]], kv)
    assert core.calls == [("decode", [2, 5], [[7, 8], [9, 0]], [1, 3], [2, 1], 2)]
    assert out[:, 0].tolist() == [201.0, 500.0]  # row 0's last new token is position 1, row 1's position 0
    assert kv.lengths[[2, 5]].tolist() == [3, 4]


def test_equal_new_groups_rows_by_count_and_splits_to_limits() -> None:
    core = Recording(StepLayout(window=False, equal_new=True, max_rows=2, max_new=2))
    kv = core.new_kv_cache(6, 64)
    kv.lengths[:] = [4, 4, 4, 4, 4, 4]
    out = core.decode([0, 1, 2, 3], [[1], [2, 3, 4], [5], [6]], kv)
    assert [(c[1], c[2], c[3]) for c in core.calls] == [
        ([0, 2], [[1], [5]], [4, 4]), ([3], [[6]], [4]),  # one-token rows, at most 2 a run
        ([1], [[2, 3]], [4]), ([1], [[4]], [6])]  # the chunk, at most 2 new tokens a run
    assert out[:, 0].tolist() == [0.0, 100.0, 200.0, 300.0] and kv.lengths.tolist() == [5, 7, 5, 5, 4, 4]


def test_last_logits_only_graph_gives_one_row() -> None:
    core = Recording(StepLayout(window=False), logits="last")
    kv = core.new_kv_cache(2, 64)
    kv.lengths[:] = 1
    core.decode([1], [[3, 4, 5]], kv)
    assert core.calls[-1][-1] == 1


def test_window_step_runs_dummy_rows_at_their_length_and_chunks_alone() -> None:
    core = Recording(StepLayout(window=True, equal_new=True))
    kv = core.new_kv_cache(4, 32)
    kv.lengths[:] = [3, 5, 2, 0]
    out = core.decode([2, 0, 3], [[20], [10], [7, 8]], kv)
    assert core.calls == [("decode", [0, 1, 2], [[10], [0], [20]], [3, 5, 2], [1, 1, 1], 1),  # row 1: a dummy
                          ("decode", [3], [[7, 8]], [0], [2], 2)]
    assert out[:, 0].tolist() == [200.0, 0.0, 301.0] and kv.lengths.tolist() == [4, 5, 3, 2]


def test_window_prefill_groups_consecutive_slots() -> None:
    core = Recording(StepLayout(window=True, max_rows=2))
    kv = core.new_kv_cache(5, 32)
    out = core.prefill([0, 1, 2, 4], [[1, 2], [3], [4, 5, 6], [7]], kv)
    assert [c[1] for c in core.calls] == [[0, 1], [2], [4]]
    assert out[:, 0].tolist() == [0.0, 100.0, 200.0, 400.0]


def test_a_full_row_in_the_window_is_a_limit_error_and_nothing_runs() -> None:
    core = Recording(StepLayout(window=True))
    kv = core.new_kv_cache(3, 4)
    kv.lengths[:] = [1, 4, 1]  # row 1 is full; the step's rows 0 and 2 have room, but the window holds row 1
    with pytest.raises(LimitError, match=r"rows 0..2 is full"):
        core.decode([0, 2], [[1], [2]], kv)
    assert core.calls == [] and kv.lengths.tolist() == [1, 4, 1]


class Reusing(Recording):
    """A backend that writes every run's logits into one buffer it keeps (as the ONNX Runtime engines do)."""

    def _run(self, graph: str, kv: KVCache, rows: StepRows) -> np.ndarray:
        value = super()._run(graph, kv, rows)
        if not hasattr(self, "buffer") or self.buffer.shape != value.shape:
            self.buffer = np.empty_like(value)
        self.buffer[...] = value
        return self.buffer


def test_logits_are_copied_unless_the_caller_reads_them_before_the_next_call() -> None:
    core = Reusing(StepLayout(window=False, equal_new=False), logits="last")
    kv = core.new_kv_cache(4, 64)
    kept = core.prefill([0, 1], [[1, 2], [3]], kv)
    lent = core.decode([0, 1], [[4], [5]], kv, keep=False)  # one run: the backend's buffer itself
    assert np.shares_memory(lent, core.buffer) and lent[:, 0].tolist() == [0.0, 100.0]
    core.decode([1, 0], [[6], [7]], kv)
    assert lent[:, 0].tolist() == [100.0, 0.0]  # overwritten by the next run, as lent
    assert kept[:, 0].tolist() == [0.0, 100.0] and not np.shares_memory(kept, core.buffer)
    split = Reusing(StepLayout(window=False, equal_new=False, max_rows=1), logits="last")
    kv = split.new_kv_cache(4, 64)
    out = split.prefill([2, 3], [[1], [2]], kv, keep=False)  # two runs: the first's rows must not be overwritten
    assert out[:, 0].tolist() == [200.0, 300.0]
