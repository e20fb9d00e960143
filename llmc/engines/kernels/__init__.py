"""llmc's own ONNX Runtime CPU operators: `ai.llmc.CachedAttention` (attention_kernel.c) and `ai.llmc.MatMulQ4`
(matmul_q4.c; each file says why it exists).

They are built with the package (setup.py: one shared library, `_llmc_ops*.so`, beside these sources) when llmc is
installed, so `llmc build` and a deployment need no compiler. An engine that uses them records the library's
contract version (ops_version.h) and refuses a library of another version at load; engines of llmc 0.1 carry their
own compiled copy in their folder and keep using it. The library talks to ONNX Runtime only through the versioned
C API table it is handed at registration (no link against ONNX Runtime), and picks its code path at run time from
the CPU it runs on: AVX-512 (VNNI for MatMulQ4), AVX2 (MatMulQ4) or portable C (LLMC_KERNELS_GENERIC=1 forces the
portable one, LLMC_KERNELS_AVX2=1 MatMulQ4's AVX2 one).
"""

from __future__ import annotations

import ctypes
import functools
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

from llmc.errors import BackendUnavailableError, EngineError, ManifestError
from llmc.manifest import EngineSettings

HERE = Path(__file__).parent
Q4_PATHS = {0: "portable", 1: "avx2", 2: "avx512-vnni"}


def library_path() -> Path:
    """The package's operator library; a one-line error when the installation did not build it."""
    for suffix in EXTENSION_SUFFIXES:
        path = HERE / f"_llmc_ops{suffix}"
        if path.is_file():
            return path
    raise BackendUnavailableError(
        f"llmc's operator library is not built in {HERE}: install llmc where a C compiler is present "
        "(pip install -e . / make install), or build without --attention llmc / --matmul llmc")


@functools.cache
def _library() -> Any:
    return ctypes.CDLL(str(library_path()))


def ops_version() -> str:
    """The installed library's contract version (ops_version.h)."""
    fn = _library().llmc_ops_version
    fn.restype = ctypes.c_char_p
    return str(fn().decode())


def cpu_paths() -> dict[str, str]:
    """The code paths the operators take on this CPU (as the environment overrides them now)."""
    lib = _library()
    return {"attention": "avx512" if lib.llmc_ops_attention_path() else "portable",
            "matmul_q4": Q4_PATHS.get(int(lib.llmc_ops_q4_path()), "portable")}


def engine_library(settings: EngineSettings, directory: Path) -> Path | None:
    """The library an engine's sessions register, from what its manifest recorded (None: it uses no llmc
    operator); a library of another contract version is a clear error."""
    version = settings.llmc_ops
    if version:
        have = ops_version()
        if str(version) != have:
            raise ManifestError(f"{directory} was built with llmc's operators version {version}; this installation "
                                f"has version {have}: build the engine again with this llmc")
        return library_path()
    legacy = settings.custom_ops
    if legacy:
        path = Path(directory) / str(legacy)
        if not path.is_file():
            raise EngineError(f"{path} is missing: the engine's graphs use the llmc operators it holds")
        return path
    return None


def register(session_options: Any, library: Path, threads: int = 0) -> None:
    """Register an operator library with an ONNX Runtime SessionOptions. `threads`: the session's intra-op threads,
    which the 4-bit kernel splits its weights among (one contiguous part each)."""
    if threads > 0:
        session_options.add_session_config_entry("llmc.threads", str(threads))
    session_options.register_custom_ops_library(str(library))
