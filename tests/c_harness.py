"""Building the C harnesses under scripts/ from llmc's operator sources, as their headers say (CC where it is set,
as setup.py builds the operators)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "llmc" / "engines" / "kernels"


def build(script: str, kernels: tuple[str, ...], out: Path) -> Path:
    """scripts/`script` linked with the operator sources `kernels` into `out`; the compiler's errors fail the test."""
    sources = [ROOT / "scripts" / script] + [KERNELS / f for f in kernels]
    compiler = os.environ.get("CC", "cc")
    built = subprocess.run([compiler, "-O2", "-std=gnu11", "-fno-math-errno", "-Wall", f"-I{KERNELS}",
                            *map(str, sources), "-o", str(out), "-lpthread", "-lm"],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return out
