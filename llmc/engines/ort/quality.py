"""Precision chosen by measurement: which linear layers of a quantized engine stay at the low precision, which are
raised, so that the engine's answers agree with the model's (`--quality-target`, llmc verify's top-1 agreement).

1. Calibrate: the fp32 export's greedy continuations of a calibration prompt set (not llmc verify's), scored in one
   graph where every linear layer is an If between its exact and its low-precision product, chosen by a 0/1 input
   per layer (layers.calibrated). A layer's sensitivity is the mean next-token KL(model || this) with only that
   layer at low precision. Such a run starts at that layer's block: the blocks before it compute what the all-exact
   run did, which handed on their outputs (graph/resume.py), so a run costs about half the model. A layer's
   experts are measured in one run together (measured_together).
2. Rank the layers by it; a raised layer keeps its own low-precision weights where those are exact (GGUF's own
   4-bit grid: then the int8 activations are all the error) and takes wider activations (16-bit in llmc's 4-bit
   operator, the same bytes; fp32 in MatMulNBits), else it goes to 8-bit weights with fp32 activations. The
   calibration graph predicts the agreement with the k most sensitive layers raised; the smallest k that reaches
   the target is the first layout tried.
3. The build makes that engine and measures it as llmc verify does; short of the target, more layers are raised.
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from llmc.engines.base import Engine
from llmc.graph import io_names
from llmc.graph.checkpoint import Checkpoint
from llmc.graph.decoder import build_graph
from llmc.graph.layers import CALIBRATE_INPUT, CALIBRATE_POSITIONS, GraphOptions
from llmc.graph.quant import (
    Q2TILES,
    Q4TILES,
    Q8TILES,
    TILE_BLOCK,
    QuantSpec,
    dequantize,
    quantize_as,
    ternary_blocks,
    unpack_q2_tiles,
    unpack_q4_tiles,
    unpack_q8_tiles,
)
from llmc.graph.resume import CALIBRATE_START, RESUME_PREFIX, NotResumable
from llmc.manifest import GraphSpec, ModelSpec, TensorSpec
from llmc.onnx_store import WeightFile, make_model
from llmc.progress import Progress, Quiet
from llmc.runtime.verify import greedy_traces, log_softmax

CALIBRATION_PROMPTS = (  # (each run of the calibration graph scores them all: keep it short)
    "Describe how a bicycle works.",
    "Write a short email asking a colleague to move a meeting to Friday.",
    "What are the main causes of the seasons on Earth?",
    "Give three reasons to learn a second language.",
    "Explain what a linked list is, with a small example.",
    "How many minutes are there in a week? Explain.",
)
CONTINUATION = 16  # greedy tokens of the model scored after each calibration prompt
EXACT_WEIGHTS = 1e-4  # relative error below which a layer's low-precision weights count as the model's own
CLOSER = 2.0  # how much closer 8-bit weights must hold a layer than its own 4-bit ones for a raise to take them
REPORT_EVERY = 30.0  # seconds between the sensitivity step's progress lines


@dataclass(frozen=True)
class Sensitivity:
    name: str  # the linear layer (its weight's name without ".weight"; "lm_head")
    kl: float  # mean next-token KL when only this layer is at the low precision
    raise_to: str  # the precision it gets when raised


class PrecisionSearch:
    """Calibration of one checkpoint at one QuantSpec: every candidate layer's sensitivity, and the layouts that
    raise the k most sensitive."""

    def __init__(self, ckpt: Checkpoint, names: list[str], spec: QuantSpec, sequences: list[list[int]],
                 library: Path | None, threads: int, max_bytes_ratio: float = 1.15, moe: str = "standard",
                 scratch: Path | None = None, progress: Progress | None = None) -> None:
        """`sequences`: the calibration prompts, each followed by the model's greedy continuation (continuations);
        `scratch`: the folder the calibration graph's files go in (the build's work folder: removed with it);
        `progress`: told how many layers have been measured and what is left, every REPORT_EVERY seconds."""
        self.spec = spec
        self.names = names
        self._tmp = tempfile.TemporaryDirectory(dir=scratch)  # the calibration graph's files, for the session's life
        self._session, weights, handed = _calibration_session(ckpt, names, spec, Path(self._tmp.name), library,
                                                              threads, moe)
        self._feeds = {**_feeds(ckpt, sequences), **weights}
        self._resumes = handed is not None  # (else every run computes every block)
        self._blocks = [_block(ckpt.spec, n) for n in names]
        # the all-exact run, which returns what each block hands on: the later runs start at their first low layer's
        # block with those fed (resume.py); this one skips no block, so what it is fed there is never read
        handed = handed or {}
        self._feeds.update((RESUME_PREFIX + v, np.zeros(0, helper.tensor_dtype_to_np_dtype(t)))
                           for v, t in handed.items())
        logits, *outs = self._session.run([io_names.LOGITS, *handed], self._run_feeds(np.zeros(len(names),
                                                                                               np.float32)))
        self._feeds.update((RESUME_PREFIX + v, a) for v, a in zip(handed, outs, strict=True))
        self._reference = log_softmax(logits[0])  # [N, V]: the scored positions
        groups = measured_together(names)
        starts = self._blocks if self._resumes else [0] * len(names)
        report = _Remaining(progress or Quiet(), [ckpt.spec.num_layers - starts[g[0]] for g in groups],
                            whole=ckpt.spec.num_layers, after=1 + math.ceil(math.log2(len(names) + 1)))
        kls = np.zeros(len(names))
        for k, group in enumerate(groups):
            low = np.zeros(len(names), np.float32)
            low[group] = 1.0
            kls[group] = self._kl(low)
            report.done(k)
        self.sensitivities = [Sensitivity(n, float(kls[i]), _raise_to(ckpt, n, spec)) for i, n in enumerate(names)]
        ranked = sorted(range(len(names)), key=lambda i: -self.sensitivities[i].kl)
        self.order, self._extra = _affordable(ckpt, spec, names, self.sensitivities, ranked, max_bytes_ratio)

    def release(self) -> None:
        """Let the calibration graph's session and files go (their memory: every layer at both precisions) once
        first_k has been asked; layout() and extra_bytes() still answer."""
        self._session, self._feeds = None, {}
        self._tmp.cleanup()

    def extra_bytes(self, k: int) -> int:
        """The weight bytes layout(k) adds to the engine with every layer at its base precision."""
        return sum(self._extra[i] for i in self.order[:k])

    def layout(self, k: int) -> tuple[tuple[str, str], ...]:
        """The k most sensitive layers at their raised precision."""
        return tuple((self.names[i], self.sensitivities[i].raise_to) for i in self.order[:k])

    def predicted_top1(self, k: int) -> float:
        """Top-1 agreement with the model, in the calibration graph, with the k most sensitive layers raised."""
        low = np.ones(len(self.names), np.float32)
        low[self.order[:k]] = 0.0
        test = self._logprobs(low)
        return float((test.argmax(-1) == self._reference.argmax(-1)).mean())

    def first_k(self, target: float) -> int:
        """The fewest raised layers the calibration predicts to reach `target` (binary search; all if none do)."""
        lo, hi = 0, len(self.order)
        if self.predicted_top1(0) >= target:
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.predicted_top1(mid) >= target else (mid, hi)
        return hi

    def _run_feeds(self, low: np.ndarray) -> dict[str, np.ndarray]:
        """The feeds of a run with `low`'s layers at low precision: it starts at the block of its first."""
        if not self._resumes:
            return {**self._feeds, CALIBRATE_INPUT: low}
        first = min((b for b, x in zip(self._blocks, low, strict=True) if x > 0.5), default=0)
        return {**self._feeds, CALIBRATE_INPUT: low, CALIBRATE_START: np.array(first, np.int64)}

    def _logprobs(self, low: np.ndarray) -> np.ndarray:
        return log_softmax(self._session.run([io_names.LOGITS], self._run_feeds(low))[0][0])

    def _kl(self, low: np.ndarray) -> float:
        test = self._logprobs(low)
        return float((np.exp(self._reference) * (self._reference - test)).sum(-1).mean())


def measured_together(names: list[str]) -> list[list[int]]:
    """The candidates' indices in the groups one calibration run measures: a layer's experts' same product
    (`layers.3.experts.*.gate_up`) as one, each other layer alone. A mixture's experts are many (Granite 3's 1B
    MoE: 32 a layer, 1,585 candidates; 97 runs so) and each sees a few of the calibration tokens; they share the
    group's sensitivity, so a search raises them together."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(re.sub(r"\.experts\.\d+\.", ".experts.*.", name), []).append(i)
    return list(groups.values())


class _Remaining:
    """The sensitivity runs' progress, told every REPORT_EVERY seconds: how many are done and about how long the rest
    take, from the runs timed so far as a fixed part (the embedding, the head) plus a part per block computed.
    `blocks`: each run's count of blocks computed; `after`: the whole runs (`whole` blocks) of first_k's search."""

    def __init__(self, progress: Progress, blocks: list[int], whole: int, after: int) -> None:
        self.progress, self.blocks, self.after = progress, blocks, [whole] * after
        self.start = self.last = self.previous = time.monotonic()
        self.times: list[float] = []

    def done(self, i: int) -> None:
        now = time.monotonic()
        self.times.append(now - self.previous)
        self.previous = now
        if now - self.last < REPORT_EVERY or i + 1 == len(self.blocks):
            return
        self.last = now
        done = np.array(self.blocks[:i + 1], np.float64)
        rest = np.array(self.blocks[i + 1:] + self.after, np.float64)
        if np.ptp(done) > 0:  # (runs from different blocks: fixed + per-block cost fitted)
            per_block, fixed = np.polyfit(done, self.times, 1)
            left = float(np.maximum(fixed + per_block * rest, 0.0).sum())
        else:
            left = float(np.mean(self.times)) * len(rest)
        self.progress.detail(f"{i + 1} of {len(self.blocks)} runs in {_minutes(now - self.start)}, "
                             f"about {_minutes(left)} left")


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _block(m: ModelSpec, name: str) -> int:
    """The block a candidate layer is in (the head: after the last), so the first a run with it low must compute."""
    parts = name.split(".")
    if parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1])
    return m.num_layers - 1 if name == "lm_head" else 0


def gains_nothing(ckpt: Checkpoint, name: str) -> bool:
    """A layer no raise can bring closer to the model: a BitNet product (its input rounded to int8 per token by the
    model, and by llmc's operators as the model does: ModelSpec.act_quant) whose weights are ternary in every block
    of 32 (held exactly on the 4-bit grids: quant.ternary_blocks). The search leaves it at the base precision."""
    w = ckpt.weights[name]
    if not (ckpt.spec.act_quant and name.startswith("layers.")) or w.shape[0] % TILE_BLOCK:
        return False
    k, n = w.shape
    return bool(ternary_blocks(w.reshape(k // TILE_BLOCK, TILE_BLOCK, n), 1)[0].all())


def _affordable(ckpt: Checkpoint, spec: QuantSpec, names: list[str], sens: list[Sensitivity], ranked: list[int],
                max_ratio: float) -> tuple[list[int], dict[int, int]]:
    """The ranked layers, less those whose raise would take the weight bytes past `max_ratio` times every layer
    at the base precision (taken in rank order), and the bytes each kept one's raise adds."""
    base = sum(a.nbytes for n in names for a in quantize_as(_float_weight(ckpt, n), "w", spec.precision_of(n),
                                                              spec).values())
    budget, kept, extras = (max_ratio - 1.0) * base, [], {}
    for i in ranked:
        extra = extra_bytes(ckpt, spec, ((names[i], sens[i].raise_to),))
        if extra <= budget:
            kept.append(i)
            extras[i] = extra
            budget -= extra
    return kept, extras


def continuations(reference: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt followed by the model's greedy continuation (from the fp32 export): PrecisionSearch's sequences."""
    return [p + tokens for p, (_, tokens) in zip(prompts, greedy_traces(reference, prompts, CONTINUATION), strict=True)]


def _raise_to(ckpt: Checkpoint, name: str, spec: QuantSpec) -> str:
    """Wider activations on the layer's own low-precision weights when those are the model's (16-bit ones in llmc's
    4-bit operator: the same bytes; else fp32 ones), else 8-bit weights; an 8-bit layer keeps its weights and takes
    16-bit activations in two int8 levels (MatMulNBits has no fast 8-bit path with fp32 activations on the CPU:
    ~110 ms a call for SmolLM2's head, measured). 4-bit weights are the model's where they hold it exactly (GGUF
    Q4_1's and Q4_0's grids) or, in llmc's operator, about as closely as 8-bit ones would (a GGUF Q4_K block's
    scale and min are products that fp16 rounds, 2-5e-4 of the weights either way: 8 bits would double the bytes
    for nothing)."""
    base = spec.precision_of(name)
    if base == "int8":
        return "int8-act16"
    w = _float_weight(ckpt, name)
    err = _repacked_error(w, base, spec)
    if err > EXACT_WEIGHTS and not (spec.q4_tiles(4) and err <= CLOSER * _repacked_error(w, "int8", spec)):
        return "int8"  # (MatMulNBits' fp32 activations are its slow path: there only exact weights keep 4 bits)
    return "int4-act16" if spec.q4_tiles(4) else "int4-fp32act"


def _repacked_error(w: np.ndarray, precision: str, spec: QuantSpec) -> float:
    """How far a weight [K, N] at `precision` is from its float values (relative Frobenius norm)."""
    parts = quantize_as(w, "w", precision, spec)
    bits = int(precision.removeprefix("int").split("-")[0])
    if "w" + Q4TILES in parts:
        back = unpack_q4_tiles(parts["w" + Q4TILES], w.shape[1])
    elif "w" + Q8TILES in parts:
        back = unpack_q8_tiles(parts["w" + Q8TILES], w.shape[1])
    elif "w" + Q2TILES in parts:  # (ternary columns: exact)
        back = unpack_q2_tiles(parts["w" + Q2TILES], w.shape[1])
    else:
        back = dequantize({k.removeprefix("w"): v for k, v in parts.items()}, spec.for_bits(bits))
    return float(np.linalg.norm(back - w) / max(float(np.linalg.norm(w)), 1e-30))


def _float_weight(ckpt: Checkpoint, name: str) -> np.ndarray:
    if name == "lm_head":
        m = ckpt.spec
        return ckpt.weights["embed.weight" if m.tie_embeddings else "lm_head.weight"].T  # (a view: see COLUMN_CHUNK)
    return ckpt.weights[name + ".weight"]


def _calibration_session(ckpt: Checkpoint, names: list[str], spec: QuantSpec, tmp: Path, library: Path | None,
                         threads: int, moe: str = "standard") -> tuple[Any, dict[str, np.ndarray], dict[str, int] | None]:
    """The decomposed decode graph (logits at the scored positions, an empty past, no present outputs) with every
    candidate layer in both precisions and its blocks resumable (resume.py), the weights each run feeds it, and the
    values its blocks hand on (name: ONNX element type). The weights fed are the candidates' exact weights and the
    embedding, the checkpoint's own arrays (the export's file as mapped: load_checkpoint) read where they are, as
    graph inputs. The graph's own file holds the rest: the low-precision forms, a tied head's transpose, the small
    weights its fusions want constant. (Written there too, the float weights took a second copy of the model on disk
    and in the page cache.) The values are None where the blocks could not be made resumable."""
    import onnxruntime as ort

    from llmc.engines.kernels import register

    weights = dict(ckpt.weights)
    for name in names:
        w = _float_weight(ckpt, name)
        weights[name + ".weight"] = w  # the exact product's
        weights.update(quantize_as(w, name + ".weight", spec.precision_of(name), spec))  # the low one's (ungated)
    m = ckpt.spec
    kv = io_names.kv_spec(m, "float32")
    base = io_names.decode_spec(m, kv, file="calibration.onnx")
    extra = (TensorSpec(CALIBRATE_INPUT, "float32", (len(names),)), TensorSpec(CALIBRATE_POSITIONS, "int64", ("n", 2)))
    logits = TensorSpec(io_names.LOGITS, "float32", (1, "n", m.logits_size))  # only the scored positions
    spec_g = GraphSpec(base.file, (*base.inputs, *extra), (logits,), base.logits)
    opts = GraphOptions(attention="decomposed", quant=spec, calibrate=tuple(names), moe=moe,  # the engine's mixture
                        resume=True)
    try:
        graph, used = build_graph(Checkpoint(m, weights), spec_g, "float32", 17, opts)
    except NotResumable:  # (every run then computes every block)
        opts = replace(opts, resume=False)
        graph, used = build_graph(Checkpoint(m, weights), spec_g, "float32", 17, opts)
    handed = {i.name.removeprefix(RESUME_PREFIX): i.type.tensor_type.elem_type for i in graph.input
              if i.name.startswith(RESUME_PREFIX)} if opts.resume else None
    own = [n + ".weight" for n in names] + ["embed.weight"]
    fed = {n: weights[n] for n in own
           if n in used and weights[n] is ckpt.weights.get(n) and weights[n].flags.c_contiguous}
    graph.input.extend(helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                       for n, a in fed.items())
    used = [n for n in used if n not in fed]
    store = WeightFile(tmp / "weights.bin")
    try:
        for n in used:
            store.add(n, weights[n])
    finally:
        store.close()
    domains = {"com.microsoft": 1, "ai.llmc": 1}
    onnx.save(make_model(graph, store, used, 17, domains), str(tmp / spec_g.file))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    # the float products run on the weights as the file maps them: a packed copy of its own would hold the model
    # once more (2 GB of a 0.5 B-parameter model's build), and each product here has every scored sequence's
    # ~240 rows to pack its weights for
    so.add_session_config_entry("session.disable_prepacking", "1")
    if library is not None:
        register(so, library, threads)
    return ort.InferenceSession(str(tmp / spec_g.file), so, providers=["CPUExecutionProvider"]), fed, handed


def _feeds(ckpt: Checkpoint, sequences: list[list[int]]) -> dict[str, np.ndarray]:
    """Right-padded feeds for the sequences, with the (row, position) of every scored position: those whose logits
    predict a continuation token (the prompt's last one and all but the last continuation token)."""
    m = ckpt.spec
    width = max(map(len, sequences))
    ids = np.zeros((len(sequences), width), np.int64)
    mask = np.zeros_like(ids)
    for b, s in enumerate(sequences):
        ids[b, :len(s)], mask[b, :len(s)] = s, 1
    feeds = {io_names.INPUT_IDS: ids, io_names.ATTENTION_MASK: mask,
             io_names.POSITION_IDS: np.tile(np.arange(width, dtype=np.int64), (len(sequences), 1))}
    kv = io_names.kv_spec(m, "float32")
    for j, name in enumerate(kv.names("past")):
        feeds[name] = np.zeros((len(sequences), kv.dims(j // 2)[0], 0, kv.dims(j // 2)[1]), np.float32)
    for state in kv.states:  # (a state before a prompt: zeros)
        feeds.update((name, np.zeros((len(sequences), *state.shape), np.float32)) for name in state.names("past"))
    scored = [(b, t) for b, s in enumerate(sequences) for t in range(len(s) - CONTINUATION - 1, len(s) - 1)]
    feeds[CALIBRATE_POSITIONS] = np.array(scored, np.int64)
    return feeds



def extra_bytes(ckpt: Checkpoint, spec: QuantSpec, layout: tuple[tuple[str, str], ...]) -> int:
    """The weight bytes `layout` adds to the engine with every layer at its base precision."""
    total = 0
    for name, precision in layout:
        w = _float_weight(ckpt, name)
        raised, base = (quantize_as(w, "w", p, spec) for p in (precision, spec.precision_of(name)))
        total += sum(a.nbytes for a in raised.values()) - sum(a.nbytes for a in base.values())
    return total
