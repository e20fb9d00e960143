"""The Ray Serve application's settings: one frozen config, from the CLI or a Ray Serve config file's `args`
(importable without Ray)."""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args, get_type_hints

from llmc.errors import InputError
from llmc.runtime.config import SERVE_STEP_TOKENS, RuntimeConfig


@dataclass(frozen=True)
class RayAppConfig:
    engine_dir: str
    model_name: str | None = None  # what clients pass as `model`; None: the engine folder's name
    replicas: int = 1  # engine replicas (the initial count when autoscaling)
    min_replicas: int | None = None  # autoscaling bounds: set either to hand the count to Ray Serve's autoscaler
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0  # autoscaling: requests in flight per replica Ray Serve aims at
    threads: int = 1  # engine threads per replica (and the CPUs Ray reserves for it)
    max_running: int = 8
    max_queue: int = 16  # per replica: Ray routes at most max_running + max_queue requests to one replica
    kv_budget_mb: int = 512
    max_step_tokens: int = SERVE_STEP_TOKENS
    chat_template: str | None = None
    api_key: str | None = None
    max_queued_requests: int = 256  # requests waiting at the ingress for a free replica; past it: 429

    def __post_init__(self) -> None:
        for flag, text in (("engine_dir", self.engine_dir), ("--served-model-name", self.model_name),
                           ("--chat-template", self.chat_template)):
            if text is not None and not text.strip():
                raise InputError(f"{flag} must not be empty, got {text!r}")
        if self.api_key is not None and (not self.api_key.strip() or not self.api_key.isascii()
                                         or not self.api_key.isprintable()):
            raise InputError("--api-key (or LLMC_API_KEY) must be printable ASCII and not empty")
        self.runtime()  # the engine's own checks (threads, step tokens against max running), before any replica
        for name in ("replicas", "threads", "max_running", "kv_budget_mb", "max_step_tokens", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise InputError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not 0 < self.target_ongoing_requests < math.inf:
            raise InputError(f"--target-ongoing-requests must be a finite number > 0, got "
                             f"{self.target_ongoing_requests}")
        lo, hi = self.min_replicas, self.max_replicas
        if lo is not None and lo < 0:
            raise InputError(f"--min-replicas must be >= 0, got {lo}")
        if hi is not None and hi < max(1, lo or 0):
            raise InputError(f"--max-replicas ({hi}) must be >= max(1, --min-replicas ({lo or 0}))")
        if self.autoscaling and not (lo or 0) <= self.replicas <= (hi or self.replicas):
            raise InputError(f"--replicas ({self.replicas}) must lie within [--min-replicas {lo or 0}, "
                             f"--max-replicas {hi if hi is not None else '(not set)'}]")

    def runtime(self) -> RuntimeConfig:
        return RuntimeConfig(threads=self.threads, max_running=self.max_running, kv_budget_mb=self.kv_budget_mb,
                             max_step_tokens=self.max_step_tokens, chat_template=self.chat_template,
                             kv_prefault=True)  # a replica serves: its KV memory held from the start

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def autoscaling_config(self) -> dict[str, Any] | None:
        if not self.autoscaling:
            return None
        return {"min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                "max_replicas": self.max_replicas or max(self.replicas, self.min_replicas or 1),
                "initial_replicas": self.replicas, "target_ongoing_requests": self.target_ongoing_requests}

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_queue

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> RayAppConfig:
        """From a Ray Serve config file's `args`; an unknown or missing key, or a value of the wrong type, is a
        one-line error."""
        if not isinstance(args, Mapping):
            raise InputError(f"the llmc Ray Serve app's args must be a mapping of settings, got {type(args).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - names, key=str)
        if unknown:
            raise InputError(f"unknown llmc Ray Serve arg {unknown[0]!r}; known: {', '.join(sorted(names))}")
        if "engine_dir" not in args:
            raise InputError("the llmc Ray Serve app needs args.engine_dir (an engine folder)")
        hints = get_type_hints(cls)
        for name, value in args.items():
            kinds = get_args(hints[name]) if isinstance(hints[name], types.UnionType) else (hints[name],)
            if not any(_is_a(value, kind) for kind in kinds):
                what = " or ".join(_KIND_NAMES[k] for k in kinds)
                raise InputError(f"llmc Ray Serve arg {name!r} must be {what}, got {value!r}", name)
        return cls(**args)


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _is_a(value: Any, kind: type) -> bool:
    """`value` is of a settings field's type, as YAML gives it: an integer counts as a number, a bool as neither."""
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)
