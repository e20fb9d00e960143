"""TensorRT optimization profiles: planned from the build limits, recorded in the manifest, checked before each run.

TensorRT needs, for every dynamic axis of every input, a range [min, max] and the size its kernels are tuned for
(opt). The in-place graphs ("onnx" attention flavour of `llmc.graph.io_names.inplace_specs`: input_ids and
position_ids [B, S], past_key_values.{i}.key|value [B, Hkv, max_seq, D]) have three kinds of dynamic axis:

- batch (B), rows run together: 1 .. max_batch_size in both engines.
- sequence (S), new tokens per row: 1 .. max_input_len in the prefill engine. In the decode engine S is 1 (one token
  per step), or 1 .. max_num_tokens when max_num_tokens is set so prompt chunks can be appended through it.
- max_sequence, the KV buffer's length. This is the capacity of the cache buffer that is bound as both past and
  present, not a per-step length, so it is FIXED: min = opt = max = max_seq_len. Each row's past length travels in
  position_ids (values, not shapes), and the buffers never change shape, so their addresses stay stable and the
  decode step can be captured in a CUDA graph.

opt follows TensorRT-LLM: (max + 1) // 2, with min 1. Fixed axes (Hkv, D) are min = opt = max.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmc.errors import EngineError, InputError, LimitError
from llmc.graph import io_names as io
from llmc.manifest import GraphSpec

Shape = tuple[int, ...]
GRAPHS = ("prefill", "decode")


@dataclass(frozen=True)
class TrtLimits:
    """What a TensorRT engine is built for; every run must fit inside these."""

    max_batch_size: int = 8
    max_input_len: int = 512  # prompt tokens per row in one prefill
    max_seq_len: int = 2048  # KV positions per row (the cache buffer's length)
    max_num_tokens: int | None = None  # new tokens per row in one decode run; None: 1 (decode only)

    def __post_init__(self) -> None:
        for flag, value in (("--max-batch-size", self.max_batch_size), ("--max-input-len", self.max_input_len),
                            ("--max-seq-len", self.max_seq_len), ("--max-num-tokens", self.decode_tokens)):
            if value < 1:
                raise InputError(f"{flag} must be >= 1, got {value}")
        if self.max_input_len > self.max_seq_len:
            raise InputError(f"--max-input-len {self.max_input_len} exceeds --max-seq-len {self.max_seq_len}")
        if self.decode_tokens > self.max_seq_len:
            raise InputError(f"--max-num-tokens {self.decode_tokens} exceeds --max-seq-len {self.max_seq_len}")

    @property
    def decode_tokens(self) -> int:
        """New tokens per row the decode engine accepts."""
        return 1 if self.max_num_tokens is None else self.max_num_tokens

    def check_model(self, max_positions: int) -> None:
        if self.max_seq_len > max_positions:
            raise LimitError(f"--max-seq-len {self.max_seq_len} exceeds the model's {max_positions} positions")


def opt_size(maximum: int) -> int:
    """TensorRT-LLM's choice of the tuned size: the middle of [1, max]."""
    return (maximum + 1) // 2


@dataclass(frozen=True)
class InputRange:
    """One input's profile: its manifest shape (axis names or fixed sizes) and min/opt/max per axis."""

    axes: tuple[int | str, ...]
    min: Shape
    opt: Shape
    max: Shape


@dataclass(frozen=True)
class Profile:
    graph: str  # "prefill" | "decode"
    inputs: dict[str, InputRange]

    def to_json(self) -> dict[str, dict[str, list[int]]]:
        return {name: {"min": list(r.min), "opt": list(r.opt), "max": list(r.max)} for name, r in self.inputs.items()}

    @classmethod
    def from_json(cls, graph: str, spec: GraphSpec, data: Mapping[str, Any]) -> Profile:
        """Read a recorded profile back, with axis names from the graph's manifest spec."""
        axes = {t.name: t.shape for t in spec.inputs}
        missing = set(axes) - set(data)
        if missing:
            raise EngineError(f"{graph} profile in the manifest lacks inputs {sorted(missing)[:4]}")
        return cls(graph, {name: InputRange(axes[name], tuple(r["min"]), tuple(r["opt"]), tuple(r["max"]))
                           for name, r in data.items()})


def axis_ranges(limits: TrtLimits, graph: str) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of each symbolic axis of the in-place graphs, for one graph."""
    seq = limits.max_input_len if graph == "prefill" else limits.decode_tokens
    batch = limits.max_batch_size
    return {io.BATCH: (1, opt_size(batch), batch), io.SEQ: (1, opt_size(seq), seq),
            io.MAX_SEQ: (limits.max_seq_len,) * 3}


def plan_profile(limits: TrtLimits, graph: str, spec: GraphSpec) -> Profile:
    ranges = axis_ranges(limits, graph)
    inputs = {}
    for t in spec.inputs:
        per_axis = []
        for axis in t.shape:
            if isinstance(axis, int):
                per_axis.append((axis, axis, axis))
            elif axis in ranges:
                per_axis.append(ranges[axis])
            else:
                raise InputError(f"{graph} input {t.name} has axis {axis!r}: TensorRT profiles are planned for the "
                                 "in-place graphs only (axes batch, sequence, max_sequence)")
        inputs[t.name] = InputRange(t.shape, *(tuple(r[k] for r in per_axis) for k in range(3)))
    return Profile(graph, inputs)


def plan_profiles(limits: TrtLimits, prefill: GraphSpec, decode: GraphSpec) -> dict[str, Profile]:
    """One profile per engine: {"prefill": ..., "decode": ...}."""
    return {"prefill": plan_profile(limits, "prefill", prefill), "decode": plan_profile(limits, "decode", decode)}


def _hint(graph: str, axis: int | str) -> str:
    flag = {io.BATCH: "--max-batch-size", io.MAX_SEQ: "--max-seq-len",
            io.SEQ: "--max-input-len" if graph == "prefill" else "--max-num-tokens"}.get(str(axis))
    return f"; rebuild with a larger {flag} or send less" if flag else ""


def check_shapes(profile: Profile, shapes: Mapping[str, Sequence[int]]) -> None:
    """Refuse a run that TensorRT would reject, quoting the engine's min/opt/max for the offending dimension."""
    extra = set(shapes) - set(profile.inputs)
    missing = set(profile.inputs) - set(shapes)
    if extra or missing:
        raise EngineError(f"{profile.graph} engine inputs differ: missing {sorted(missing)[:4]}, "
                          f"unexpected {sorted(extra)[:4]}")
    for name, r in profile.inputs.items():
        shape = tuple(int(d) for d in shapes[name])
        if len(shape) != len(r.min):
            raise EngineError(f"{profile.graph} input {name} has rank {len(shape)}, the engine expects {len(r.min)}")
        for dim, (value, lo, opt, hi) in enumerate(zip(shape, r.min, r.opt, r.max)):
            if not lo <= value <= hi:
                axis = r.axes[dim] if dim < len(r.axes) else dim
                raise LimitError(
                    f"{profile.graph} input {name} dimension {dim} ({axis}) is {value}, outside the engine's "
                    f"optimization profile min {lo} / opt {opt} / max {hi}{_hint(profile.graph, axis)}"
                )
