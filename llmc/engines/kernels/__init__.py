"""llmc's own ONNX Runtime CPU operators: `ai.llmc.CachedAttention` (attention_kernel.c) and `ai.llmc.MatMulQ4`
(matmul_q4.c; each file says why it exists).

`llmc build --attention llmc` or `--quant int4 --matmul llmc` compiles them with the machine's C compiler into the
engine folder (`libllmc_ops.so`, hashed in the manifest like every other file); an engine registers the library with
each ONNX Runtime session it opens, so a deployment needs the file, not a compiler. The library talks to ONNX Runtime
only through the versioned C API table it is handed at registration (no link against ONNX Runtime), and picks its
code path at run time from the CPU it runs on: AVX-512 (VNNI for MatMulQ4), AVX2 (MatMulQ4) or portable C
(LLMC_KERNELS_GENERIC=1 forces the portable one, LLMC_KERNELS_AVX2=1 MatMulQ4's AVX2 one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from llmc.errors import EngineError, InputError

LIBRARY = "libllmc_ops.so"
SOURCES = ("attention_kernel.c", "matmul_q4.c", "ort_op.c")
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fno-math-errno", "-fvisibility=hidden", "-Wall")
HERE = Path(__file__).parent


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc, gcc or clang on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def compile_library(out_dir: Path, wanted_by: str = "--attention llmc") -> Path:
    """Compile the operator library into out_dir; a one-line error when there is no compiler or it fails.
    `wanted_by`: the option that needs it, for the error."""
    cc = compiler()
    if cc is None:
        raise InputError(f"{wanted_by} compiles llmc's operators with a C compiler and none was found "
                         "(set CC, or install gcc); the default build needs none")
    out = Path(out_dir) / LIBRARY
    cmd = [cc, *FLAGS, "-o", str(out), *(str(HERE / s) for s in SOURCES), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except OSError as e:
        raise EngineError(f"could not run the C compiler {cc}: {e}") from e
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["?"]
        raise EngineError(f"compiling llmc's operators with {cc} failed: {errors[0].strip()}")
    return out


def register(session_options: object, directory: Path, library: str = LIBRARY, threads: int = 0) -> None:
    """Register the engine folder's operator library (`library`: its file name, as the manifest records it; engines
    of earlier versions name theirs libllmc_attention.so) with an ONNX Runtime SessionOptions. `threads`: the
    session's intra-op threads, which the 4-bit kernel splits its weights among (one contiguous part each)."""
    path = Path(directory) / library
    if threads > 0:
        session_options.add_session_config_entry("llmc.threads", str(threads))  # type: ignore[attr-defined]
    if not path.is_file():
        raise EngineError(f"{path} is missing: the engine's graphs use the llmc operators it holds")
    session_options.register_custom_ops_library(str(path))  # type: ignore[attr-defined]
