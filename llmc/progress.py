"""Progress reporting for slow stages, kept apart from the stages themselves (the CLI passes a console one)."""

from __future__ import annotations

import sys
import time
from typing import Protocol


class Progress(Protocol):
    def step(self, message: str) -> None: ...

    def detail(self, message: str) -> None:
        """How far the current step has got (a long one: a 1.5 B-parameter model's sensitivities take 10 minutes)."""


class Quiet:
    def step(self, message: str) -> None:
        pass

    def detail(self, message: str) -> None:
        pass


class ConsoleSteps:
    """Numbered steps with elapsed time, on stderr so stdout stays clean for results. A stage that takes more steps
    than planned (a quality search raising more layers, a fallback build) moves the total along."""

    def __init__(self, total: int, prefix: str = "") -> None:
        self.total, self.prefix, self.n = total, prefix, 0
        self.t0 = time.perf_counter()

    def step(self, message: str) -> None:
        self.n += 1
        self.total = max(self.total, self.n)
        elapsed = time.perf_counter() - self.t0
        print(f"{self.prefix}[{self.n}/{self.total}] {message}  ({elapsed:.1f}s)", file=sys.stderr, flush=True)

    def detail(self, message: str) -> None:
        print(f"{self.prefix}      {message}", file=sys.stderr, flush=True)
