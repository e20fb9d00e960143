"""The import direction: the runtime, the engines and the CLI load without torch, transformers, gguf or the exporter,
so a deployment needs only the runtime's small dependencies."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "gguf", "llmc.export")

CHECK = """
import importlib, json, sys
importlib.import_module({module!r})
heavy = {heavy!r}
print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))))
"""


@pytest.mark.parametrize("module", ["llmc", "llmc.runtime.llm", "llmc.engines.ort.run", "llmc.engines.registry",
                                    "llmc.cli.main"])
def test_module_does_not_import_the_exporter(module: str) -> None:
    code = CHECK.format(module=module, heavy=HEAVY)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing {module} loaded {loaded}"


def test_the_check_itself_can_fail() -> None:
    """Guard against a check that passes vacuously: importing the exporter is seen."""
    code = CHECK.format(module="llmc.export.exporter", heavy=HEAVY)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "llmc.export.exporter" in loaded
