"""Kernel checks under Triton's interpreter (TRITON_INTERPRET=1, chosen when triton is imported, so they run in a
child process): the check scripts' main, and the tests' runner of a script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def interpret_main(run_case: Callable[[Any, str], dict[str, Any]], cases: Sequence[Any]) -> None:
    """A check script's main: one JSON line per case and dtype (argv: the dtypes; default float32 and float16)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from llmc.engines.trt.plugin import BLOCK_N

    assert BLOCK_N == 64, BLOCK_N  # the cases' block arithmetic assumes it
    for dtype in sys.argv[1:] or ["float32", "float16"]:
        for case in cases:
            print(json.dumps(run_case(case, dtype)), flush=True)


def run_interpreter(script: Path) -> list[dict[str, Any]]:
    """Run a check script in the interpreter; its JSON results (a failing script fails the caller)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
