"""ONNX Runtime CPU engine: two sessions (prefill, decode-with-past) over one KV memory."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmc.engines.base import Engine, EngineOptions, KVCache
from llmc.engines.host_kv import HostKVCache
from llmc.engines.ort.weights import MappedWeights, StreamedWeights
from llmc.engines.ort.weights import enabled as huge_pages_enabled
from llmc.engines.steps import StepCore, StepLayout, StepRows
from llmc.errors import BackendUnavailableError, EngineError, ManifestError
from llmc.graph import io_names
from llmc.manifest import EngineManifest, GraphSpec, verify_files
from llmc.onnx_store import check_external_paths, load_graph

CPU_PROVIDER = "CPUExecutionProvider"


def default_threads() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


# ONNX Runtime's CPU operators that split their work over its intra-op pool where it pays (products, attention,
# convolutions, mixtures of experts): a graph with one keeps ONNX Runtime's pool. Shape, index and elementwise
# nodes over a row or a prompt (the embedding's Gather, the last norm, casts) run on one thread either way.
POOLED_OPS = frozenset({"MatMul", "Gemm", "MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul", "FusedMatMul",
                        "QLinearMatMul", "MatMulIntegerToFloat", "GroupQueryAttention", "MultiHeadAttention",
                        "Attention", "Conv", "ConvTranspose", "MoE", "QMoE", "Einsum"})


def uses_own_pool(graph: Any, threads: int) -> bool:
    """Whether llmc's operators run their parallel calls on llmc's own thread pool (kernels/pool.h) instead of
    ONNX Runtime's, the session then on one thread: where every node that splits its work is llmc's (the int4,
    int8 and bf16 engines with llmc's operators). A decode step is ~210 short parallel calls, and ONNX Runtime's
    ParallelFor costs more per call than llmc's spin pool (docs/performance_notes.md). LLMC_POOL=onnxruntime
    keeps ONNX Runtime's pool everywhere."""
    choice = os.environ.get("LLMC_POOL", "auto") or "auto"
    if choice not in ("auto", "onnxruntime"):
        raise EngineError(f"LLMC_POOL={choice!r}: must be auto (llmc's pool where every parallel node is llmc's) "
                          "or onnxruntime")
    if choice == "onnxruntime" or threads < 2:
        return False
    return not any(n.op_type in POOLED_OPS for n in graph.graph.node if n.domain in ("", "ai.onnx", "com.microsoft"))


def make_session(path: Path, spec: GraphSpec, threads: int, library: Path | None = None,
                 providers: Sequence[Any] = (CPU_PROVIDER,), weights: StreamedWeights | None = None,
                 prepack: bool = True, mapped: MappedWeights | None = None) -> object:
    """One ONNX Runtime session; `library`: llmc's operator library to register, when the graph uses it;
    `providers`: the execution providers in ONNX Runtime's form (ort-cuda: CUDA first); `weights`: where llmc's
    operators' weights are held in huge pages (weights.py), shared by the engine's sessions; `prepack`: False
    leaves ONNX Runtime's float products on the weights as the file maps them (see OrtEngineBase.prepack), `mapped`
    the mapping they are given from (shared by the engine's sessions)."""
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - onnxruntime is a runtime dependency
        raise BackendUnavailableError("onnxruntime is not installed: pip install onnxruntime") from None
    graph = load_graph(path)
    check_external_paths(path, graph)
    own_pool = library is not None and tuple(providers) == (CPU_PROVIDER,) and uses_own_pool(graph, threads)
    so = ort.SessionOptions()
    # with llmc's pool the session keeps no intra-op workers of its own: three spinning threads on two cores
    so.intra_op_num_threads = 1 if own_pool else threads
    so.inter_op_num_threads = 1
    # The pool's workers stop spinning when a run ends, so another session of the process (the concat engine's
    # second graph, another engine) has the cores to itself. Measured with an engine of two sessions: time to first
    # token 185-210 -> 150-170 ms fp32, decode unchanged (spinning between the kernels of one run is kept).
    so.add_session_config_entry("session.force_spinning_stop", "1")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.log_severity_level = 3
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if mapped is not None:
        mapped.add_to(so, graph)
    if library is not None:
        from llmc.engines.kernels import register

        register(so, library, threads, own_pool=own_pool)
        if weights is not None:
            weights.add_to(so, path)
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
    # ONNX Runtime prepacks each float product's weights into a copy of its own, in each session: an fp32 export's
    # two sessions then hold its weights three times (the file's mapping and two packed copies: a 2 GB model's
    # reference engine 5.9 GB). False runs them on the mapping alone, page cache shared with every reader of the
    # file: 0.08 GB anonymous, at ~1.5x the decode step and ~1.2x the prefill (measured, 0.5 B parameters, fp32).
    prepack: bool = True

    def __init__(self, manifest: EngineManifest, directory: Path, options: EngineOptions) -> None:
        self.manifest = manifest
        self.directory = Path(directory)
        verify_files(self.directory, manifest.files)
        self.threads = options.threads or manifest.settings.threads or default_threads()
        from llmc.engines.kernels import engine_library

        library = engine_library(manifest.settings, self.directory)
        self._weights = StreamedWeights() if library is not None and huge_pages_enabled() else None
        self._mapped = None if self.prepack or library is not None else MappedWeights(self.directory)
        self._prefill = make_session(self.directory / manifest.prefill.file, manifest.prefill, self.threads,
                                     library, self.providers, self._weights, self.prepack, self._mapped)
        # one graph for both (in-place engines): one session, so the weights are prepacked and held once
        self._decode = self._prefill if manifest.decode == manifest.prefill else make_session(
            self.directory / manifest.decode.file, manifest.decode, self.threads, library, self.providers,
            self._weights, self.prepack, self._mapped)
        self._past_names = manifest.kv.names("past")
        self._state_names = manifest.kv.state_names("past")  # (per-sequence states beside the KV cache: LFM2's)


class OrtEngine(StepCore, OrtEngineBase):
    """The "concat" KV layout: past [B, Hkv, P, D] in, present [B, Hkv, P+S, D] out; we keep each slot compact."""

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        return HostKVCache(self.manifest.kv, num_slots, min(max_len, self.max_positions))

    def step_layout(self, kv: KVCache) -> StepLayout:
        return StepLayout(window=False, equal_new=False)  # any rows (the past is gathered), mixed new counts

    def _run(self, graph: str, kv: KVCache, rows: StepRows) -> np.ndarray:
        """Rows' past gathered to the longest (holes masked), the new positions of each present written back."""
        assert isinstance(kv, HostKVCache)
        past_len = int(rows.start.max())
        width = rows.ids.shape[1]
        mask = np.zeros((len(rows.slots), past_len + width), np.int64)
        for b, (cached, n) in enumerate(zip(rows.start, rows.counts)):
            mask[b, :cached] = 1
            mask[b, past_len:past_len + n] = 1
        feeds = {io_names.INPUT_IDS: rows.ids, io_names.ATTENTION_MASK: mask, io_names.POSITION_IDS: rows.positions}
        if graph == "decode":
            feeds.update(zip(self._past_names, kv.gather(rows.slots, past_len)))
            feeds.update(zip(self._state_names, kv.state_rows(rows.slots)))
        session = self._decode if graph == "decode" else self._prefill
        try:
            logits, *present = session.run(None, feeds)  # type: ignore[attr-defined]
        except Exception as e:  # onnxruntime raises its own exception types; surface one line
            raise EngineError(f"onnxruntime failed: {str(e).splitlines()[0]}") from e
        if self._state_names:
            kv.store_states(rows.slots, present[len(self._past_names):])
        for b, (slot, n) in enumerate(zip(rows.slots, rows.counts)):
            kv.write(slot, int(rows.start[b]), present, b, slice(past_len, past_len + int(n)))
        return logits  # type: ignore[no-any-return]
