"""The machine's memory read bandwidth right now, read the way a decode step reads its weights: the engine's
thread count streaming a buffer far larger than the caches with wide loads and software prefetch (llmc's operator
library, bandwidth.c), or, where that library is not built, ONNX Runtime's ReduceSum over it (which reads about half
as fast on some VMs: 10 against 19-25 GB/s on 2 cores of an Intel Xeon VM).

`llmc bench` runs it in a child process (`python -m llmc.bench.bandwidth THREADS`) at the start and at the end of a
run, so that its buffer stays out of the bench's peak RSS. On a shared machine the bandwidth moves from one minute to
the next; the two figures say how fast the machine was while the run's numbers were taken.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np


def measure_read_gbs(threads: int, mib: int = 512, repeats: int = 9) -> float:
    """Median GB/s of `repeats` reads of `mib` MiB by `threads` threads (0: physical cores)."""
    import ctypes

    from llmc.engines.kernels import library_path
    from llmc.errors import BackendUnavailableError

    if threads < 1:
        from llmc.engines.ort.run import default_threads

        threads = default_threads()
    try:
        fn = ctypes.CDLL(str(library_path())).llmc_read_gbs
    except (BackendUnavailableError, OSError, AttributeError):
        return ort_read_gbs(threads, mib, repeats)
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    gbs = float(fn(threads, mib * 2**20, repeats))
    return gbs if gbs > 0 else ort_read_gbs(threads, mib, repeats)


def ort_read_gbs(threads: int, mib: int = 256, repeats: int = 10) -> float:
    """Median GB/s of a ReduceSum over `mib` MiB of float32 bound in place (nothing copied in or out)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n = mib * 2**20 // 4
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "read",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = np.ones(n, np.float32)  # written once: every page is real memory
    binding = session.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_output("y")
    session.run_with_iobinding(binding)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - start)
    return float(x.nbytes / np.median(times) / 1e9)


def probe(threads: int, timeout_s: float = 120.0) -> float | None:
    """measure_read_gbs in a child process; None if it could not run (the bench goes on without it)."""
    try:
        done = subprocess.run([sys.executable, "-m", "llmc.bench.bandwidth", str(threads)], capture_output=True,
                              text=True, timeout=timeout_s, check=True)
        return round(float(done.stdout.strip().splitlines()[-1]), 1)
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


if __name__ == "__main__":
    print(measure_read_gbs(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
