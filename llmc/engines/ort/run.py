"""ONNX Runtime CPU engine: two sessions (prefill, decode-with-past) over one KV memory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmc.engines.base import Engine, EngineOptions, KVCache
from llmc.engines.host_kv import HostKVCache
from llmc.errors import BackendUnavailableError, EngineError, ManifestError
from llmc.graph import io_names
from llmc.manifest import EngineManifest, GraphSpec, verify_files
from llmc.onnx_store import check_external_paths

CPU_PROVIDER = "CPUExecutionProvider"


def default_threads() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def make_session(path: Path, spec: GraphSpec, threads: int, library: Path | None = None,
                 providers: Sequence[Any] = (CPU_PROVIDER,)) -> object:
    """One ONNX Runtime session; `library`: llmc's operator library to register, when the graph uses it;
    `providers`: the execution providers in ONNX Runtime's form (ort-cuda: CUDA first)."""
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - onnxruntime is a runtime dependency
        raise BackendUnavailableError("onnxruntime is not installed: pip install onnxruntime") from None
    check_external_paths(path)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # The pool's workers stop spinning when a run ends, so another session of the process (the concat engine's
    # second graph, another engine) has the cores to itself. Measured with an engine of two sessions: time to first
    # token 185-210 -> 150-170 ms fp32, decode unchanged (spinning between the kernels of one run is kept).
    so.add_session_config_entry("session.force_spinning_stop", "1")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.log_severity_level = 3
    if library is not None:
        from llmc.engines.kernels import register

        register(so, library, threads)
    try:
        session = ort.InferenceSession(str(path), so, providers=list(providers))
    except Exception as e:  # onnxruntime's own exception types: report one line
        raise EngineError(f"onnxruntime could not load {path.name}: {str(e).splitlines()[0]}") from e
    _check_names(path.name, spec, [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()])
    return session


def _check_names(file: str, spec: GraphSpec, inputs: list[str], outputs: list[str]) -> None:
    """Compare the manifest's I/O names with the graph's and report both differences."""
    for kind, expected, actual in (("inputs", spec.input_names(), inputs), ("outputs", spec.output_names(), outputs)):
        missing, extra = set(expected) - set(actual), set(actual) - set(expected)
        if missing or extra:
            raise ManifestError(
                f"{file}: {kind} differ from the manifest: missing {sorted(missing)[:4]}, unexpected {sorted(extra)[:4]}"
            )


class OrtEngineBase(Engine):
    """Two ONNX Runtime sessions over the engine folder's graphs, checked against the manifest at load."""

    providers: tuple[Any, ...] = (CPU_PROVIDER,)  # where the sessions run (a subclass may choose another)

    def __init__(self, manifest: EngineManifest, directory: Path, options: EngineOptions) -> None:
        self.manifest = manifest
        self.directory = Path(directory)
        verify_files(self.directory, manifest.files)
        self.threads = options.threads or manifest.settings.threads or default_threads()
        from llmc.engines.kernels import engine_library

        library = engine_library(manifest.settings, self.directory)
        self._prefill = make_session(self.directory / manifest.prefill.file, manifest.prefill, self.threads,
                                     library, self.providers)
        # one graph for both (in-place engines): one session, so the weights are prepacked and held once
        self._decode = self._prefill if manifest.decode == manifest.prefill else make_session(
            self.directory / manifest.decode.file, manifest.decode, self.threads, library, self.providers)
        self._past_names = manifest.kv.names("past")


class OrtEngine(OrtEngineBase):
    """The "concat" KV layout: past [B, Hkv, P, D] in, present [B, Hkv, P+S, D] out; we keep each slot compact."""

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        return HostKVCache(self.manifest.kv, num_slots, min(max_len, self.max_positions))

    def _run(self, session: object, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return session.run(None, feeds)  # type: ignore[attr-defined, no-any-return]
        except Exception as e:  # onnxruntime raises its own exception types; surface one line
            raise EngineError(f"onnxruntime failed: {str(e).splitlines()[0]}") from e

    def prefill(self, slots: list[int], prompts: list[list[int]], kv: KVCache) -> np.ndarray:
        assert isinstance(kv, HostKVCache)
        lens = [len(p) for p in prompts]
        kv.check_room(slots, lens)
        ids, mask, pos = _right_padded(prompts, start=np.zeros(len(prompts), np.int64), past=0)
        feeds = {io_names.INPUT_IDS: ids, io_names.ATTENTION_MASK: mask, io_names.POSITION_IDS: pos}
        logits, *present = self._run(self._prefill, feeds)
        for row, (slot, n) in enumerate(zip(slots, lens)):
            kv.write(slot, 0, present, row, slice(0, n))
            kv.lengths[slot] = n
        return logits[:, 0, :]  # type: ignore[no-any-return]

    def decode(self, slots: list[int], tokens: list[list[int]], kv: KVCache) -> np.ndarray:
        assert isinstance(kv, HostKVCache)
        counts = [len(t) for t in tokens]
        kv.check_room(slots, counts)
        start = kv.lengths[slots].copy()
        past_len = int(start.max())
        ids, new_mask, pos = _right_padded(tokens, start=start, past=past_len)
        feeds = {io_names.INPUT_IDS: ids, io_names.ATTENTION_MASK: new_mask, io_names.POSITION_IDS: pos}
        feeds.update(zip(self._past_names, kv.gather(slots, past_len)))
        logits, *present = self._run(self._decode, feeds)
        for row, (slot, n) in enumerate(zip(slots, counts)):
            kv.write(slot, int(start[row]), present, row, slice(past_len, past_len + n))
            kv.lengths[slot] += n
        return logits[np.arange(len(tokens)), np.array(counts) - 1]  # type: ignore[no-any-return]


def _right_padded(rows: list[list[int]], start: np.ndarray, past: int) -> tuple[np.ndarray, ...]:
    """input_ids [B, S], attention_mask [B, past + S], position_ids [B, S] for right-padded rows.

    Row b has start[b] cached tokens (positions 0..start[b]-1 of the past, the rest of the past is a hole).
    """
    batch, width = len(rows), max(len(r) for r in rows)
    ids = np.zeros((batch, width), np.int64)
    mask = np.zeros((batch, past + width), np.int64)
    pos = np.zeros((batch, width), np.int64)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
        mask[b, : start[b]] = 1
        mask[b, past : past + len(row)] = 1
        pos[b, : len(row)] = start[b] + np.arange(len(row))
    return ids, mask, pos
