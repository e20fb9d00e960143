"""Physical limits a benchmark is judged against: bytes each decode step must read and the machine's bandwidth, and
the arithmetic a prompt's prefill must do and the machine's matrix throughput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from llmc.graph.quant import BLOCKSUMS, OFFSETS, TILE_OPS
from llmc.manifest import EngineManifest, EngineSettings
from llmc.onnx_store import load_graph

# Measured on the development machine (2 cores): ~35 GB/s memory bandwidth. Override with --bandwidth-gbs.
DEFAULT_BANDWIDTH_GBS = 35.0
WEIGHT_OPS = {"MatMul", "MatMulNBits", "Gemm", "FusedMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
              *TILE_OPS.values(), "MatMulBF16", "MoE"}  # llmc's own operators (ai.llmc), ONNX Runtime's mixture of experts


def weight_bytes_per_step(engine_dir: Path, manifest: EngineManifest) -> int:
    """Bytes of every weight a decode step streams from memory: the initializers feeding matrix products.

    The embedding table is not counted unless a product reads it (a tied LM head does): a Gather reads B rows.
    A mixture's experts count for the share one token runs (experts_per_token of num_experts): batch 1's bytes.
    A weight several products read (Zamba2's shared blocks, one per use) counts once a product: between uses the
    other layers' weights stream through the caches.
    """
    model = load_graph(Path(engine_dir) / manifest.decode.file)
    sizes = {}
    for init in model.graph.initializer:
        n = 1
        for d in init.dims:
            n *= d
        sizes[init.name] = n * _itemsize(init.data_type)
    read: list[str] = []
    for node in model.graph.node:
        if node.op_type in WEIGHT_OPS:
            read.extend(dict.fromkeys(i for i in node.input if i in sizes))  # (each of a node's weights once)
    m = manifest.model
    share = m.experts_per_token / m.num_experts if m.num_experts else 1.0
    return int(sum(sizes[n] * (share if ".experts." in n else 1.0) for n in read))


MATRIX_KINDS = {1: "amx-bf16", 2: "avx512-vnni-int8", 3: "avx512-bf16", 4: "avx512-fp32-fma",
                5: "avx2-fp32-fma"}  # matrix_peak.c's kinds
PRECISIONS = {"int": 0, "bf16": 1, "fp32": 2}  # the weights' class, as matrix_peak.c's llmc_matrix_peak_kind_for


def weights_class(settings: EngineSettings) -> str:
    """What an engine's products compute in: "int" (int4 / int8 weights: int8 dot products or AMX-BF16 tiles),
    "bf16" (llmc's MatMulBF16) or "fp32" (ONNX Runtime's own products)."""
    if settings.quant in ("int4", "int8"):
        return "int"
    return "bf16" if settings.dtype == "bfloat16" else "fp32"


def matrix_peak(threads: int, weights: str = "int", repeats: int = 5) -> tuple[str, float] | None:
    """The matrix instructions the prompts' products of an engine whose weights are of class `weights`
    (weights_class) take on this CPU and their throughput in GFLOP/s over `threads` threads, measured now (operator
    library, matrix_peak.c); None where they take a portable path or the library is not built."""
    import ctypes

    from llmc.engines.kernels import library_path
    from llmc.errors import BackendUnavailableError

    try:
        lib = ctypes.CDLL(str(library_path()))
        kind = int(lib.llmc_matrix_peak_kind_for(PRECISIONS[weights]))
        fn = lib.llmc_matrix_gflops
    except (BackendUnavailableError, OSError, AttributeError):
        return None
    if kind not in MATRIX_KINDS:
        return None
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    gflops = float(fn(kind, threads, repeats))
    return (MATRIX_KINDS[kind], round(gflops, 1)) if gflops > 0 else None


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8")  # /proc/cpuinfo's names of what the operators dispatch on


def _first_cpu() -> dict[str, str]:
    """/proc/cpuinfo's fields for the first CPU (empty where there is no such file)."""
    cpuinfo = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in cpuinfo.read_text(errors="replace").splitlines() if cpuinfo.is_file() else []:
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> set[str]:
    """Every flag /proc/cpuinfo lists for the first CPU (empty where there is no such file)."""
    return set(_first_cpu().get("flags", "").split())


def host_cpu() -> dict[str, Any]:
    """The CPU a run measured, so a row says which machine it is from (the machines here change between sessions,
    some with their BF16 or AMX extensions masked): its model name, which of ISA_FLAGS it lists, and the paths
    llmc's operators take on it now (llmc.engines.kernels.cpu_paths; absent without the library)."""
    cpu = _first_cpu()
    flags = set(cpu.get("flags", "").split())
    info: dict[str, Any] = {"cpu_model": cpu.get("model name", ""), "cpu_flags": [f for f in ISA_FLAGS if f in flags]}
    from llmc.engines.kernels import cpu_paths
    from llmc.errors import BackendUnavailableError

    try:
        info["kernel_paths"] = cpu_paths()
    except (BackendUnavailableError, OSError, AttributeError):  # no library built: the row names no paths
        pass
    return info


def prefill_flops(engine_dir: Path, manifest: EngineManifest, prompt_len: int) -> float:
    """Floating-point operations (a multiply-add is 2) one prompt's prefill does: every linear layer's product as
    the engine's graph holds it for each token (a folded int8 layer's K includes its offsets' rows; the block sums
    feeding them are left out) and the LM head once (the prefill computes the last position's logits only), plus
    causal attention's scores and weighted sums (each layer's window where it has one). An unrolled mixture's experts
    count for the share one token runs (ONNX Runtime's fused MoE node is not counted)."""
    model = load_graph(Path(engine_dir) / manifest.decode.file)
    dims = {init.name: tuple(init.dims) for init in model.graph.initializer}
    m = manifest.model
    share = m.experts_per_token / m.num_experts if m.num_experts else 1.0
    per_token = head = 0.0
    for node in model.graph.node:
        attrs = {a.name: a.i for a in node.attribute}
        if len(node.input) > 1 and node.input[1].endswith((BLOCKSUMS, OFFSETS)):  # a quantized layer's offset terms
            continue
        if node.op_type in (*TILE_OPS.values(), "MatMulBF16", "MatMulNBits"):
            macs = float(attrs["K"] * attrs["N"])
        elif node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and len(dims.get(node.input[1], ())) == 2:
            k, n = dims[node.input[1]][::-1] if attrs.get("transB") else dims[node.input[1]]
            macs, attrs["N"] = float(k * n), n
        else:
            continue
        if attrs["N"] == m.logits_size or node.input[1].startswith("lm_head"):  # (a head in row slices: lm_head.partI)
            head += macs
        else:
            per_token += macs * (share if ".experts." in node.input[1] else 1.0)  # (an unrolled mixture's expert)
    attention = 0.0
    for layer in range(m.num_layers):
        window, chunk = m.window(layer), m.chunk(layer)  # (a chunked layer's query: the keys of its own block)
        keys = sum(min(i + 1, window) if window else i % chunk + 1 if chunk else i + 1 for i in range(prompt_len))
        attention += 4.0 * m.num_heads * m.head_dim * keys  # q.k and p.v: a multiply-add each per key and dim
    return 2.0 * (per_token * prompt_len + head) + attention


def kv_bytes_copied_per_step(manifest: EngineManifest, batch: int, context: int, bytes_per_token: int) -> int:
    """KV bytes copied per decode step besides the new token's own K/V: none for the in-place layout; for concat,
    the past is gathered into the feed and concatenated into present (two copies of the whole cache)."""
    if manifest.kv.layout == "inplace":
        return 0
    return 2 * batch * context * bytes_per_token


def _itemsize(data_type: int) -> int:
    sizes: dict[int, int] = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.UINT8: 1,
            onnx.TensorProto.INT8: 1, onnx.TensorProto.INT64: 8, onnx.TensorProto.INT32: 4,
            onnx.TensorProto.BFLOAT16: 2}
    return sizes.get(data_type, 4)
