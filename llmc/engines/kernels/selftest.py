"""The operator library checked against the ONNX Runtime installed, through every entry of ONNX Runtime's C API
table it uses (ort_op.c reaches them by hand-typed positions in that versioned table: a table that differs would
mean a crash or wrong numbers, never an error message).

Each check runs one-node sessions the way engines do and compares them with numpy: MatMulQ4 at both activation
widths (and a prompt's rows) and MatMulQ8 over two threads (int64 attributes, inputs, outputs, dimensions, tensor data, the session config entry
llmc.threads, ParallelFor), its refusal of a bad attribute (the error status and its message), and CachedAttention
over a prompt then a decode step with a soft-cap (float attributes, in place through IOBinding). Run in a child
process by `llmc.engines.kernels.check_library` (a crash must not take the caller with it) and cached per ONNX
Runtime version and library: `python -m llmc.engines.kernels.selftest LIBRARY` prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

K, N, ROWS = 64, 48, 3
PROMPT_ROWS = 40  # a prompt: from 32 rows on MatMulQ4 may run on AMX-BF16 tiles (matmul_q4.h), 40 = 32 + 8 spare
H, HKV, D, L = 4, 2, 16, 8


def _model(node: Any, inputs: list[Any], outputs: list[Any], inits: list[Any]) -> bytes:
    from onnx import helper

    graph = helper.make_graph([node], "check", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    model.ir_version = 10
    return bytes(model.SerializeToString())


def _session(library: Path, model: bytes, threads: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4  # the refusal check's error comes back as an exception, not also as a log line
    so.intra_op_num_threads = threads
    so.add_session_config_entry("llmc.threads", str(threads))
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _grid_weight(rng: np.random.Generator) -> np.ndarray:
    """Weights on the 4-bit grid MatMulQ4 stores exactly (per block of 32 along K: fp16 scale * q + fp16 min)."""
    d = (rng.random((K // 32, N)) * 0.1 + 0.01).astype(np.float16).astype(np.float32)
    m = (rng.standard_normal((K // 32, N)) * 0.3).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (K // 32, 32, N))
    q[:, 0], q[:, 1] = 0, 15
    return (q * d[:, None] + m[:, None]).reshape(K, N).astype(np.float32)


def _matmul(library: Path, act_bits: int, bits: int = 4, rows: int = ROWS) -> str | None:
    from onnx import TensorProto, helper, numpy_helper

    from llmc.graph.quant import pack_q4_tiles, pack_q8_tiles, unpack_q8_tiles

    rng = np.random.default_rng(act_bits)
    w, bias = _grid_weight(rng), rng.standard_normal(N).astype(np.float32)
    packed = pack_q8_tiles(w) if bits == 8 else pack_q4_tiles(w)
    if bits == 8:
        w = unpack_q8_tiles(packed, N)  # the 4-bit grid to its fp16 scale
    op = f"MatMulQ{bits}"
    node = helper.make_node(op, ["x", "w", "bias"], ["y"], domain="ai.llmc", K=K, N=N, gated=0, act_bits=act_bits)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(bias, "bias")])
    x = rng.standard_normal((1, rows, K)).astype(np.float32)
    y = _session(library, model, threads=2).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ w + bias
    err = float(np.abs(y - want).max() / np.abs(want).max())
    # (a prompt's weights may be rounded to bf16 on the AMX tiles: 2^-9 of each; a broken table costs ~100 %)
    limit = 5e-2 if act_bits == 8 else 1e-3 if rows < PROMPT_ROWS else 1e-2
    if y.shape != want.shape or not err < limit:
        return f"{op} act_bits {act_bits}, {rows} rows: shape {y.shape} (want {want.shape}), error {err:.2e} (limit {limit})"
    return None


def _refusal(library: Path) -> str | None:
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("MatMulQ4", ["x", "w"], ["y"], domain="ai.llmc", K=K, N=N, gated=0, act_bits=5)
    model = _model(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", K])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [numpy_helper.from_array(np.zeros((-(-N // 32), K // 32, 640), np.uint8), "w")])
    try:
        _session(library, model, threads=1).run(None, {"x": np.zeros((1, 1, K), np.float32)})
    except Exception as e:
        return None if "act_bits 5: must be 8" in str(e) else f"MatMulQ4's refusal came back as {str(e)[:200]!r}"
    return "MatMulQ4 took act_bits 5"


def _attention(library: Path) -> str | None:
    """A 3-token prompt then one decode token, fp32 cache written in place, soft-capped scores."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from llmc.engines.trt.plugin import attention_reference

    softcap, scale = 1.5, 0.3
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("qkv", f, ["B", "S", (H + 2 * HKV) * D]),
              helper.make_tensor_value_info("past_key", f, ["B", HKV, L, D]),
              helper.make_tensor_value_info("past_value", f, ["B", HKV, L, D]),
              helper.make_tensor_value_info("seqlens_k", i32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", i32, [])]
    outputs = [helper.make_tensor_value_info("out", f, ["B", "S", H * D]),
               helper.make_tensor_value_info("present_key", f, ["B", HKV, L, D]),
               helper.make_tensor_value_info("present_value", f, ["B", HKV, L, D])]
    node = helper.make_node("CachedAttention", [v.name for v in inputs], [v.name for v in outputs], domain="ai.llmc",
                            num_heads=H, kv_num_heads=HKV, scale=scale, softcap=softcap)
    session = _session(library, _model(node, inputs, outputs, []), threads=2)
    rng = np.random.default_rng(7)
    key, value = np.zeros((1, HKV, L, D), np.float32), np.zeros((1, HKV, L, D), np.float32)
    ref_k, ref_v = key.astype(np.float64), value.astype(np.float64)
    start = 0
    for n in (3, 1):
        qkv = rng.standard_normal((1, n, (H + 2 * HKV) * D)).astype(np.float32)
        binding = session.io_binding()
        binding.bind_cpu_input("qkv", qkv)
        binding.bind_cpu_input("seqlens_k", np.array([start + n - 1], np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(start + n, np.int32))
        binding.bind_output("out", "cpu")  # the first output bound: the first copied back
        for name, buf in (("key", key), ("value", value)):
            v = ort.OrtValue.ortvalue_from_numpy(buf)
            binding.bind_ortvalue_input(f"past_{name}", v)
            binding.bind_ortvalue_output(f"present_{name}", v)
        session.run_with_iobinding(binding)
        out = binding.copy_outputs_to_cpu()[0]
        heads = qkv[0].astype(np.float64).reshape(n, H + 2 * HKV, D).transpose(1, 0, 2)
        pos = (start + np.arange(n))[None]
        want, ref_k, ref_v = attention_reference(heads[None, :H], heads[None, H:H + HKV], heads[None, H + HKV:], ref_k,
                                                 ref_v, pos, scale, softcap=softcap)
        want = want[0].transpose(1, 0, 2).reshape(n, H * D)
        err = max(float(np.abs(out[0] - want).max()), float(np.abs(key - ref_k).max()))
        if not err < 1e-4:
            return f"CachedAttention ({n} tokens after {start}): error {err:.2e} against the reference (limit 1e-4)"
        start += n
    return None


def run_checks(library: Path) -> list[str]:
    """What failed (empty: the library works with this ONNX Runtime)."""
    failures = []
    for check in (lambda: _matmul(library, 8), lambda: _matmul(library, 16), lambda: _matmul(library, 16, bits=8),
                  lambda: _matmul(library, 16, rows=PROMPT_ROWS), lambda: _refusal(library),
                  lambda: _attention(library)):
        try:
            failure = check()
        except Exception as e:  # an unexpected error is a failed check, with its first line
            failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if failure:
            failures.append(failure)
    return failures


if __name__ == "__main__":
    print(json.dumps({"failures": run_checks(Path(sys.argv[1]))}))
