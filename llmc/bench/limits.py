"""Physical limits a benchmark is judged against: bytes each decode step must read, and the machine's bandwidth."""

from __future__ import annotations

from pathlib import Path

import onnx

from llmc.manifest import EngineManifest
from llmc.onnx_store import load_graph

# Measured on the development machine (2 cores): ~35 GB/s memory bandwidth. Override with --bandwidth-gbs.
DEFAULT_BANDWIDTH_GBS = 35.0
WEIGHT_OPS = {"MatMul", "MatMulNBits", "Gemm", "FusedMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
              "MatMulQ4", "MatMulQ8", "MatMulBF16", "MoE"}  # llmc's own operators (ai.llmc), ONNX Runtime's mixture of experts


def weight_bytes_per_step(engine_dir: Path, manifest: EngineManifest) -> int:
    """Bytes of every weight a decode step streams from memory: the initializers feeding matrix products.

    The embedding table is not counted unless a product reads it (a tied LM head does): a Gather reads B rows.
    A mixture's experts count for the share one token runs (experts_per_token of num_experts): batch 1's bytes.
    """
    model = load_graph(Path(engine_dir) / manifest.decode.file)
    sizes = {}
    for init in model.graph.initializer:
        n = 1
        for d in init.dims:
            n *= d
        sizes[init.name] = n * _itemsize(init.data_type)
    read: set[str] = set()
    for node in model.graph.node:
        if node.op_type in WEIGHT_OPS:
            read.update(i for i in node.input if i in sizes)
    m = manifest.model
    share = m.experts_per_token / m.num_experts if m.num_experts else 1.0
    return int(sum(sizes[n] * (share if ".experts." in n else 1.0) for n in read))


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
