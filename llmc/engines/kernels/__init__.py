"""llmc's own ONNX Runtime CPU operators: `ai.llmc.CachedAttention` (attention_kernel.c), `ai.llmc.MatMulQ4`
(matmul_q4.c, with MatMulQ8 and MatMulQ2) and `ai.llmc.MatMulBF16` (matmul_bf16.c; each file says why it exists).

They are built with the package (setup.py: one shared library, `_llmc_ops*.so`, beside these sources) when llmc is
installed, so `llmc build` and a deployment need no compiler. An engine that uses them records the library's
contract version (ops_version.h) and refuses a library of another version at load; engines of llmc 0.1 carry their
own compiled copy in their folder and keep using it. The library talks to ONNX Runtime only through the versioned
C API table it is handed at registration (no link against ONNX Runtime), and picks its code path at run time from
the CPU it runs on: AVX-512 (VNNI for MatMulQ4/Q8/Q2, BF16 or AVX-512F for MatMulBF16, AMX-BF16 for prompts), AVX2 or
portable C (LLMC_KERNELS_GENERIC=1 forces the portable ones, LLMC_KERNELS_AVX2=1 the AVX2 ones, LLMC_KERNELS_NO_BF16=1
MatMulBF16's AVX-512F one, LLMC_KERNELS_NO_AMX=1 no tiles), and where its streaming prefetches of weights and cached
keys put the lines (prefetch.h: L2 on x86, on AMD's CPUs the 4-bit and 8-bit products' weights at three distances;
LLMC_PREFETCH=l1, l2 or l2x3 overrides, the results the same bit for bit), and how far llmc's idle pool workers
read the next decode product's weights ahead (ahead.h: LLMC_AHEAD_KB, 0 off). Before a library is first registered
with an ONNX Runtime, `check_library` runs selftest.py against it in a child process (once per ONNX Runtime version
and library, the verdict kept in the cache folder): the C code reaches ONNX Runtime's API by positions in its table,
so a table that differs shows up there as a clear error, not as a crash or wrong numbers in an engine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

from llmc.errors import BackendUnavailableError, EngineError, ManifestError
from llmc.manifest import EngineSettings

HERE = Path(__file__).parent
Q4_PATHS = {0: "portable", 1: "avx2", 2: "avx512-vnni", 3: "avx512-vnni+amx-bf16"}  # (3: prompts on AMX tiles)
BF16_PATHS = {0: "portable", 1: "avx512-bf16", 2: "amx-bf16", 3: "avx512f-widened", 4: "avx2-widened"}
PREFETCH_MODES = {0: "l1", 1: "l2", 2: "l2x3"}  # (l2x3: the 4-bit and 8-bit products' weights at three distances)


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


def ops_serves() -> tuple[str, ...]:
    """The contract versions whose graphs the installed library runs (its own and older ones it only added to)."""
    lib = _library()
    fn = getattr(lib, "llmc_ops_serves", None)
    if fn is None:
        return (ops_version(),)
    fn.restype = ctypes.c_char_p
    return tuple(fn().decode().split())


def cpu_paths() -> dict[str, str]:
    """The code paths the operators take on this CPU (as the environment overrides them now)."""
    lib = _library()
    return {"attention": "avx512" if lib.llmc_ops_attention_path() else "portable",
            "matmul_q4": Q4_PATHS.get(int(lib.llmc_ops_q4_path()), "portable"),
            "matmul_bf16": BF16_PATHS.get(int(lib.llmc_ops_bf16_path()), "portable"),
            # where the vector paths' streaming prefetches of weights and keys go (the portable ones take none)
            "prefetch": PREFETCH_MODES.get(int(lib.llmc_ops_prefetch_mode()), "l1")}


def engine_library(settings: EngineSettings, directory: Path) -> Path | None:
    """The library an engine's sessions register, from what its manifest recorded (None: it uses no llmc
    operator); a library of another contract version is a clear error."""
    version = settings.llmc_ops
    if version:
        if str(version) not in ops_serves():
            raise ManifestError(f"{directory} was built with llmc's operators version {version}; this installation "
                                f"has version {ops_version()} (it runs versions {', '.join(ops_serves())}): build the "
                                "engine again with this llmc")
        return library_path()
    legacy = settings.custom_ops
    if legacy:
        path = Path(directory) / str(legacy)
        if not path.is_file():
            raise EngineError(f"{path} is missing: the engine's graphs use the llmc operators it holds")
        return path
    return None


def _verdict_file(library: Path) -> Path:
    import onnxruntime

    from llmc.paths import cache_dir

    st = library.stat()
    key = hashlib.sha256(f"{library.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "ops-checks" / f"onnxruntime-{onnxruntime.__version__}-{key}.json"


@functools.cache
def check_library(library: Path) -> None:
    """The library's self-test (selftest.py) passed against this ONNX Runtime, run now in a child process unless a
    passing verdict is cached; else a one-line error naming what failed."""
    import onnxruntime

    verdict = _verdict_file(library)
    if verdict.is_file():
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, "-m", "llmc.engines.kernels.selftest", str(library)], env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise BackendUnavailableError(f"llmc's operators ({library.name}) did not finish their self-test against "
                                      f"ONNX Runtime {onnxruntime.__version__} in 300 s") from None
    if done.returncode != 0:
        how = (f"crashed ({signal.Signals(-done.returncode).name})" if done.returncode < 0
               else f"failed (exit {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:200]})")
        raise BackendUnavailableError(
            f"llmc's operators ({library.name}) {how} in their self-test against ONNX Runtime "
            f"{onnxruntime.__version__}: its C API table is not the one they were written for; install the "
            "ONNX Runtime llmc pins, or build without --attention llmc / --matmul llmc")
    failures = json.loads(done.stdout.strip().splitlines()[-1])["failures"]
    if failures:
        raise BackendUnavailableError(
            f"llmc's operators ({library.name}) fail their self-test against ONNX Runtime {onnxruntime.__version__}: "
            f"{failures[0]}" + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
    verdict.parent.mkdir(parents=True, exist_ok=True)
    tmp = verdict.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"library": str(library), "onnxruntime": onnxruntime.__version__, "passed": True}))
    tmp.replace(verdict)


def register(session_options: Any, library: Path, threads: int = 0, own_pool: bool = False) -> None:
    """Register an operator library with an ONNX Runtime SessionOptions (checked against this ONNX Runtime the
    first time: check_library). `threads`: the threads the kernels split their work over (the 4-bit kernel: one
    contiguous part of its weights each); `own_pool`: they run on llmc's own pool of that many threads (pool.h; the
    session itself then has one intra-op thread), else on the session's intra-op pool."""
    if os.environ.get("LLMC_OPS_SELFTEST") != "0":
        check_library(Path(library))
    if threads > 0:
        session_options.add_session_config_entry("llmc.threads", str(threads))
    if own_pool:
        session_options.add_session_config_entry("llmc.pool", "llmc")
    session_options.register_custom_ops_library(str(library))
