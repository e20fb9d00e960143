"""llmc as a wheel built here (its C operators compiled once, so an image needs no compiler), and the pinned
requirement set of the runtime + server: no torch, no transformers."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import llmc
from llmc.errors import InputError, LlmcError

SERVED_EXTRAS = ("serve",)  # what `llmc serve` needs beyond the runtime
_SOURCE_FILES = ("pyproject.toml", "setup.py", "README.md")


def source_root() -> Path:
    """The checkout llmc runs from (an editable install); a wheel is built from its sources."""
    root = Path(llmc.__file__).resolve().parent.parent
    missing = [f for f in _SOURCE_FILES[:2] if not (root / f).is_file()]
    if missing:
        raise InputError(f"llmc's sources are not at {root} (no {', '.join(missing)}): packaging builds llmc's "
                         "wheel, so run it from a source checkout (pip install -e .)")
    return root


def build_wheel(dest: Path) -> Path:
    """Build llmc's wheel into `dest` from a clean copy of its sources (never the checkout's build outputs)."""
    with tempfile.TemporaryDirectory(prefix="llmc-wheel-") as tmp:
        src = copy_sources(Path(tmp) / "src")
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest),
               str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise LlmcError(f"building llmc's wheel failed (exit {done.returncode}): {tail[0]}")
    wheels = sorted(dest.glob("llmc-*.whl"))
    if not wheels:
        raise LlmcError(f"building llmc's wheel left no llmc-*.whl in {dest}")
    return wheels[-1]


def copy_sources(dest: Path) -> Path:
    """llmc's sources (what `pip install DEST` builds from; its operators compile there), no build outputs."""
    root = source_root()
    dest.mkdir(parents=True)
    for name in _SOURCE_FILES:
        if (root / name).is_file():
            shutil.copy2(root / name, dest / name)
    shutil.copytree(root / "llmc", dest / "llmc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "*.egg-info"))
    return dest


def runtime_requirements(extras: tuple[str, ...] = SERVED_EXTRAS) -> list[str]:
    """llmc's own requirements plus `extras`', each pinned to the version installed (and tested) here."""
    out = []
    for req in metadata.requires("llmc") or []:
        spec, _, marker = req.partition(";")
        extra = re.search(r'extra\s*==\s*"([^"]+)"', marker)
        if extra is not None and extra.group(1) not in extras:
            continue
        name = re.split(r"[\s<>=!~\[;]", spec.strip(), maxsplit=1)[0]
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(spec.strip())  # not installed here: the range llmc asks for
    return sorted(set(out), key=str.lower)


def python_tag() -> str:
    """The interpreter the wheel was built for: the image's Python must be the same minor version."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"
