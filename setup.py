"""Builds llmc's ONNX Runtime operators (llmc/engines/kernels/*.c) into the package as one shared library.

It is loaded by path with SessionOptions.register_custom_ops_library, never imported: it has no Python module code
and links against neither Python nor ONNX Runtime (it reaches ONNX Runtime through the API table handed to
RegisterCustomOps). The project's metadata is in pyproject.toml.
"""

from setuptools import Extension, setup

KERNELS = "llmc/engines/kernels/"

setup(ext_modules=[Extension(
    "llmc.engines.kernels._llmc_ops",
    sources=[KERNELS + f for f in ("ahead.c", "amx_bf16.c", "attention_kernel.c", "bandwidth.c", "delta_rule.c",
                                   "matmul_bf16.c", "matmul_q4.c", "matrix_peak.c", "ort_op.c", "pool.c", "rms_norm.c")],
    depends=[KERNELS + f for f in ("ahead.h", "amx_bf16.h", "attention_kernel.h", "delta_rule.h", "matmul_bf16.h",
                                   "matmul_q4.h",
                                   "parallel.h", "ops_version.h", "pool.h", "prefetch.h", "probe_clock.h", "rms_norm.h")],
    extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-fvisibility=hidden", "-Wall"],
    libraries=["m", "pthread"],
)])
