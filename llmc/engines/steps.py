"""The step core: `prefill` and `decode` written once, for every backend.

A backend supplies one primitive, `_run(graph, kv, rows)`: run a batch of KV rows through its prefill or decode
graph, each row with `start[b]` cached tokens and `counts[b]` new ones, right-padded to one width. Everything else
(grouping rows into runs the graph accepts, dummy rows in a slot window, splitting prompt chunks to a token limit,
picking each row's last logits, the cached lengths) is here, and is the same for the ONNX Runtime concat engine,
the in-place engines (slot and paged memory), the CUDA engine and TensorRT.

What a run may hold is the backend's `StepLayout` for a cache:
- `window`: the graph binds a window of consecutive slots, rows first..first+B-1 of slot buffers (the slot in-place
  layouts: GroupQueryAttention, ONNX Attention, the TensorRT plugin). A decode step then runs the whole window, rows
  not in the step with a dummy token at their current length (their next real token overwrites it); prompts run
  in groups of consecutive slots, and prompt chunks one row per run. Otherwise a run takes any rows (paged memory
  through block tables, the concat layout's gathered past).
- `equal_new`: rows after a cached past take the same number of new tokens in one run (GroupQueryAttention,
  llmc's operator before contract 6); rows are then grouped by their number of new tokens. The concat graph (its
  attention mask) and llmc's paged operator (new_tokens) take mixed counts, right-padded: rows are then grouped so
  that little is padding (`padded_groups`).
- `max_rows` / `max_new`: rows per run and new tokens per row per decode run (0: no limit; TensorRT's profiles).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np

from llmc.engines.base import Engine, KVCache
from llmc.errors import LimitError


@dataclass(frozen=True)
class StepLayout:
    window: bool = False
    equal_new: bool = True
    max_rows: int = 0
    max_new: int = 0


@dataclass
class StepRows:
    """One run: KV rows `slots` (a window's consecutive slots where the layout has one), `ids` [B, S] right-padded
    with 0, `start` [B] cached tokens before, `counts` [B] new tokens (<= S), `logits_rows`: 1 (each row's last new
    token) or S (every position, where the graph gives them)."""

    slots: list[int]
    ids: np.ndarray
    start: np.ndarray
    counts: np.ndarray
    logits_rows: int
    live: np.ndarray | None = None  # the rows whose tokens are real (None: all; a slot window's others: a dummy)

    @property
    def first(self) -> int:
        return self.slots[0]

    @property
    def positions(self) -> np.ndarray:
        """position_ids [B, S]: start[b] + s for new tokens, 0 for pads (in range, never a row's maximum)."""
        width = self.ids.shape[1]
        if width == 1:  # (a decode step: every row has its one token)
            return self.start[:, None]
        pos = self.start[:, None] + np.arange(width, dtype=np.int64)[None, :]
        pos[np.arange(width)[None, :] >= self.counts[:, None]] = 0
        return pos.astype(np.int64)

    @property
    def seqlens(self) -> np.ndarray:
        """Tokens per row once the new ones are in (start + counts)."""
        return self.start + self.counts


def right_padded(rows: list[list[int]]) -> np.ndarray:
    ids = np.zeros((len(rows), max(len(r) for r in rows)), np.int64)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
    return ids


def runs(slots: list[int], size: int) -> list[list[int]]:
    """Indices of `slots` grouped into runs of consecutive slots, each at most `size` long (0: no limit)."""
    groups: list[list[int]] = []
    for i, slot in enumerate(slots):
        if groups and slot == slots[groups[-1][-1]] + 1 and (not size or len(groups[-1]) < size):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def windows(slots: list[int], size: int) -> list[tuple[int, int, list[int]]]:
    """(first, stop, indices of `slots` in first..stop-1): windows of at most `size` consecutive slots (0: no
    limit) covering every slot, each starting at the lowest slot not yet covered."""
    order = sorted(range(len(slots)), key=lambda i: slots[i])
    out: list[tuple[int, int, list[int]]] = []
    for i in order:
        if out and (not size or slots[i] < out[-1][0] + size):
            out[-1][2].append(i)
        else:
            out.append((slots[i], 0, [i]))
    return [(first, slots[idx[-1]] + 1, idx) for first, _, idx in out]


def padded_groups(counts: list[int]) -> list[list[int]]:
    """Indices of rows grouped for runs that take rows of different counts (right-padded to the group's longest):
    from the longest row down, a row joins the open group while the pad it adds, width - its count, is at most
    max(8, width / 4) tokens, so one-token decode rows never pad out to a prompt chunk's width (a 128-token chunk
    would make 16 decode rows compute 2,048 positions), while chunks of similar lengths share one run."""
    groups: list[list[int]] = []
    width = 0
    for i in sorted(range(len(counts)), key=lambda r: -counts[r]):
        if groups and width - counts[i] <= max(8, width // 4):
            groups[-1].append(i)
        else:
            groups.append([i])
            width = counts[i]
    return groups


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i:i + size] for i in range(0, len(items), size)] if size else [items]


class StepCore(Engine):
    """prefill/decode over the backend's `_run`; see the module's text."""

    @abstractmethod
    def step_layout(self, kv: KVCache) -> StepLayout:
        """What one run of this backend may hold, for this cache."""

    @abstractmethod
    def _run(self, graph: str, kv: KVCache, rows: StepRows) -> np.ndarray:
        """Run `rows` through the "prefill" or "decode" graph, writing their new K/V into `kv`; returns logits
        [B, rows.logits_rows, V] float32 (a buffer the backend may reuse: the core copies what it keeps)."""

    def _logits_rows(self, graph: str, width: int) -> int:
        all_rows = graph == "decode" and width > 1 and self.manifest.decode.logits == "all"
        return width if all_rows else 1

    def _run_rows(self, graph: str, kv: KVCache, slots: list[int], toks: list[list[int]],
                  keep: bool = True) -> np.ndarray:
        """Run rows `slots` with new tokens `toks` after what they have cached; logits after each row's last
        (keep=False: one logits row a sequence may be the backend's buffer, as `_run` returned it)."""
        ids = right_padded(toks)
        counts = np.array([len(t) for t in toks], np.int64)
        start = np.zeros_like(counts) if graph == "prefill" else kv.lengths[slots].copy()
        rows = StepRows(slots, ids, start, counts, self._logits_rows(graph, ids.shape[1]))
        logits = self._run(graph, kv, rows)
        kv.lengths[slots] = start + counts
        if logits.shape[1] == 1:  # (the backend may reuse its buffer: a copy unless the caller reads them at once;
            # measured on the EPYC VM in the decode loop: 40 us at batch 1, 125 at batch 8, ~1 % of a step)
            return logits[:, 0].copy() if keep else logits[:, 0]
        return logits[np.arange(len(slots)), counts - 1]  # type: ignore[no-any-return]

    def prefill(self, slots: list[int], prompts: list[list[int]], kv: KVCache, *, keep: bool = True) -> np.ndarray:
        kv.check_room(slots, [len(p) for p in prompts])
        layout = self.step_layout(kv)
        groups = runs(slots, layout.max_rows) if layout.window else _chunks(list(range(len(slots))), layout.max_rows)
        keep = keep or len(groups) > 1  # (a later run would overwrite an earlier run's buffer)
        return self._assemble(len(slots), [(g, self._run_rows("prefill", kv, [slots[i] for i in g],
                                                               [prompts[i] for i in g], keep)) for g in groups])

    def decode(self, slots: list[int], tokens: list[list[int]], kv: KVCache, *, keep: bool = True) -> np.ndarray:
        counts = [len(t) for t in tokens]
        kv.check_room(slots, counts)
        layout = self.step_layout(kv)
        if not layout.window and len(slots) <= (layout.max_rows or len(slots)) and all(n == 1 for n in counts):
            return self._run_rows("decode", kv, slots, tokens, keep)  # a decode step's usual case: one run, as it is
        parts: list[tuple[list[int], np.ndarray]] = []
        if layout.window:
            ones = [i for i, n in enumerate(counts) if n == 1]
            for first, stop, idx in windows([slots[i] for i in ones], layout.max_rows):
                rows = [ones[i] for i in idx]
                parts.append((rows, self._window_step(kv, first, stop, [slots[i] for i in rows],
                                                      [tokens[i][0] for i in rows])))
            groups = [[i] for i, n in enumerate(counts) if n != 1]  # prompt chunks: a window of one row each
        elif layout.equal_new:
            by_len: dict[int, list[int]] = {}
            for i, n in enumerate(counts):
                by_len.setdefault(n, []).append(i)
            groups = [g for rows in by_len.values() for g in _chunks(rows, layout.max_rows)]
        else:
            groups = [g for rows in padded_groups(counts) for g in _chunks(rows, layout.max_rows)]
        parts += [(g, self._extend(kv, [slots[i] for i in g], [tokens[i] for i in g], layout.max_new)) for g in groups]
        return self._assemble(len(slots), parts)

    def _assemble(self, n: int, parts: list[tuple[list[int], np.ndarray]]) -> np.ndarray:
        """Logits [n, V] from each part's (row indices, logits), written in order (a later part's row wins): a single
        part over rows 0..n-1 in order (a decode step's usual case) is returned as it is, not copied again."""
        if len(parts) == 1 and parts[0][0] == list(range(n)):
            return parts[0][1]
        out = np.empty((n, self.logits_size), np.float32)
        for rows, logits in parts:
            out[rows] = logits
        return out

    def _extend(self, kv: KVCache, slots: list[int], toks: list[list[int]], max_new: int) -> np.ndarray:
        """Append each row's tokens through the decode graph, at most `max_new` per row per run (0: all); the
        logits after each row's last token."""
        longest = max(len(t) for t in toks)
        step = max_new or longest
        parts: list[tuple[list[int], np.ndarray]] = []
        for lo in range(0, longest, step):
            live = [i for i, t in enumerate(toks) if len(t) > lo]
            logits = self._run_rows("decode", kv, [slots[i] for i in live], [toks[i][lo:lo + step] for i in live])
            parts.append((live, logits))  # a row's later pass overwrites its earlier ones in _assemble
        return self._assemble(len(slots), parts)

    def _window_step(self, kv: KVCache, first: int, stop: int, slots: list[int], tokens: list[int]) -> np.ndarray:
        """One token for each of `slots`, run as the window first..stop-1 (other rows: a dummy token)."""
        start = kv.lengths[first:stop].copy()
        if np.any(start + 1 > kv.max_len):
            raise LimitError(f"a KV slot in rows {first}..{stop - 1} is full ({kv.max_len} tokens)")
        ids = np.zeros((stop - first, 1), np.int64)
        at = np.array(slots) - first
        ids[at, 0] = tokens
        rows = StepRows(list(range(first, stop)), ids, start, np.ones(stop - first, np.int64), 1, at)
        logits = self._run("decode", kv, rows)
        kv.lengths[slots] += 1
        return logits[at, 0]  # type: ignore[no-any-return]
