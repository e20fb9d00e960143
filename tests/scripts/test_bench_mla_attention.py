"""scripts/bench_mla_attention.py: latent attention's decode shapes timed on llmc's operator and on ONNX Runtime's
GroupQueryAttention (docs/architectures.md cites its figures)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_shape_runs_on_both_operators() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_mla_attention.py"), "--heads", "4",
                          "--contexts", "16", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()
    assert line.startswith("T=16: ") and line.count(" us") == 4, line
