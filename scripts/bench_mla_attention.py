"""One decode row's attention over T cached tokens, in latent attention's form and in the expanded one.

    python scripts/bench_mla_attention.py [--heads 16] [--contexts 128,1024] [--threads 2]

DeepSeek-V2-Lite's shapes by default: 16 query heads; the latent form (what llmc builds: docs/architectures.md) is
one KV head of 576 dims (64 rotated + the 512-wide latent), the expanded form (what transformers computes after
expanding the latent) 16 KV heads of 192 (the values, 128 wide, padded to the keys' width as one op needs them).
Each shape runs on llmc's CachedAttention over an fp16 cache and on ONNX Runtime's GroupQueryAttention over an fp32
one; prints microseconds a call (one layer).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from llmc.engines.kernels import library_path


def _session(path: Path, heads: int, kv_heads: int, llmc: bool, threads: int) -> ort.InferenceSession:
    kv_type = TensorProto.FLOAT16 if llmc else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["B", "S", "W"]),
              helper.make_tensor_value_info("past_key", kv_type, ["B", kv_heads, "L", "D"]),
              helper.make_tensor_value_info("past_value", kv_type, ["B", kv_heads, "L", "D"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, ["P", "R"]),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, ["P", "R"])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", "HD"]),
               helper.make_tensor_value_info("present_key", kv_type, ["B", kv_heads, "L", "D"]),
               helper.make_tensor_value_info("present_value", kv_type, ["B", kv_heads, "L", "D"])]
    names = [i.name for i in inputs]
    if llmc:
        node = helper.make_node("CachedAttentionF16Cache", names, [o.name for o in outputs], domain="ai.llmc",
                                num_heads=heads, kv_num_heads=kv_heads, scale=0.1)
    else:
        node = helper.make_node("GroupQueryAttention", [names[0], "", "", *names[1:]], [o.name for o in outputs],
                                domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads, scale=0.1,
                                do_rotary=1)
    domain = "ai.llmc" if llmc else "com.microsoft"
    model = helper.make_model(helper.make_graph([node], "attn", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    model.ir_version = 10
    onnx.save(model, str(path))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if llmc:
        so.register_custom_ops_library(str(library_path()))
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def time_call(heads: int, kv_heads: int, dim: int, tokens: int, llmc: bool, threads: int, reps: int = 200) -> float:
    """Microseconds a call: one new token after `tokens` cached ones, 32 rotated pairs."""
    with tempfile.TemporaryDirectory() as tmp:
        session = _session(Path(tmp) / "a.onnx", heads, kv_heads, llmc, threads)
        rng = np.random.default_rng(0)
        # llmc's op writes in place into a buffer with room; GroupQueryAttention takes the past and returns past + 1
        length = tokens + 8 if llmc else tokens
        cache = np.float16 if llmc else np.float32
        angles = np.outer(np.arange(tokens + 16), np.ones(32))
        feeds = {"qkv": rng.standard_normal((1, 1, (heads + 2 * kv_heads) * dim)).astype(np.float32),
                 "past_key": rng.standard_normal((1, kv_heads, length, dim)).astype(cache),
                 "past_value": rng.standard_normal((1, kv_heads, length, dim)).astype(cache),
                 "seqlens_k": np.array([tokens], np.int32), "total_sequence_length": np.array(tokens + 1, np.int32),
                 "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
        binding = session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        for out in session.get_outputs():
            binding.bind_output(out.name)
        for _ in range(10):
            session.run_with_iobinding(binding)
        start = time.perf_counter()
        for _ in range(reps):
            session.run_with_iobinding(binding)
        return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    h = args.heads
    for tokens in (int(t) for t in args.contexts.split(",")):
        row = {"llmc fp16, latent (1 KV head x 576)": time_call(h, 1, 576, tokens, True, args.threads),
               f"llmc fp16, expanded ({h} KV heads x 192)": time_call(h, h, 192, tokens, True, args.threads),
               "GQA fp32, latent": time_call(h, 1, 576, tokens, False, args.threads),
               "GQA fp32, expanded": time_call(h, h, 192, tokens, False, args.threads)}
        print(f"T={tokens}: " + ";  ".join(f"{k}: {v:.0f} us" for k, v in row.items()))


if __name__ == "__main__":
    main()
