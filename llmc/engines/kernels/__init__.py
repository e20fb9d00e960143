"""llmc's own ONNX Runtime CPU operator, `ai.llmc.CachedAttention` (see attention_kernel.c for why).

`llmc build --attention llmc` compiles it with the machine's C compiler into the engine folder
(`libllmc_attention.so`, hashed in the manifest like every other file); an engine registers it with each ONNX Runtime
session it opens, so a deployment needs the library file, not a compiler. The library talks to ONNX Runtime only
through the versioned C API table it is handed at registration (no link against ONNX Runtime), and picks its
AVX-512 or portable path at run time from the CPU it runs on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from llmc.errors import EngineError, InputError

LIBRARY = "libllmc_attention.so"
SOURCES = ("attention_kernel.c", "ort_op.c")
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fno-math-errno", "-fvisibility=hidden", "-Wall")
HERE = Path(__file__).parent


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc, gcc or clang on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def compile_library(out_dir: Path) -> Path:
    """Compile the operator library into out_dir; a one-line error when there is no compiler or it fails."""
    cc = compiler()
    if cc is None:
        raise InputError("--attention llmc compiles its operator with a C compiler and none was found "
                         "(set CC, or install gcc); --attention gqa needs none")
    out = Path(out_dir) / LIBRARY
    cmd = [cc, *FLAGS, "-o", str(out), *(str(HERE / s) for s in SOURCES), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except OSError as e:
        raise EngineError(f"could not run the C compiler {cc}: {e}") from e
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["?"]
        raise EngineError(f"compiling the llmc attention operator with {cc} failed: {errors[0].strip()}")
    return out


def register(session_options: object, directory: Path) -> None:
    """Register the engine folder's operator library with an ONNX Runtime SessionOptions."""
    path = Path(directory) / LIBRARY
    if not path.is_file():
        raise EngineError(f"{path} is missing: the engine's graphs use the llmc attention operator it holds")
    session_options.register_custom_ops_library(str(path))  # type: ignore[attr-defined]
