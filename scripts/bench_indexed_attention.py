"""One Kolibri-1.1-shaped indexed attention layer on llmc's operator, with and without its key selection.

    python scripts/bench_indexed_attention.py [--threads 2] [--cases 2048:1,4096:1,16384:1,4096:256,16384:256]

Kolibri 1.1's shapes: 48 query heads, 4 KV heads of 128, an fp16 cache of rows, the checkpoint's budget (8 sink +
2,048 chosen + 128 local keys, 12 routing heads). Each case (keys:new tokens) runs one CachedAttentionF16Cache node
in place, without and with the index_* attributes (operators.md, contract 23); prints the median milliseconds a call
(one layer) and their ratio (docs/performance_notes.md, s57).
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

H, HKV, D = 48, 4, 128
INDEX = {"index_topk": 2048, "index_local": 128, "index_sink": 8, "index_heads": 12}


def _session(path: Path, indexed: bool, threads: int) -> ort.InferenceSession:
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["B", "S", "W"]),
              helper.make_tensor_value_info("past_key", TensorProto.FLOAT16, ["B", HKV, "L", D]),
              helper.make_tensor_value_info("past_value", TensorProto.FLOAT16, ["B", HKV, "L", D]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", H * D]),
               helper.make_tensor_value_info("present_key", TensorProto.FLOAT16, ["B", HKV, "L", D]),
               helper.make_tensor_value_info("present_value", TensorProto.FLOAT16, ["B", HKV, "L", D])]
    node = helper.make_node("CachedAttentionF16Cache", [i.name for i in inputs], [o.name for o in outputs],
                            domain="ai.llmc", num_heads=H, kv_num_heads=HKV, scale=D ** -0.5,
                            **(INDEX if indexed else {}))
    model = helper.make_model(helper.make_graph([node], "indexed", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    model.ir_version = 10
    onnx.save(model, str(path))
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library_path()))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _time(keys: int, new: int, indexed: bool, threads: int, reps: int) -> float:
    """Median milliseconds of one call: `new` tokens after keys - new cached ones."""
    with tempfile.TemporaryDirectory() as tmp:
        session = _session(Path(tmp) / "g.onnx", indexed, threads)
        rng = np.random.default_rng(0)
        cache = [rng.standard_normal((1, HKV, keys, D)).astype(np.float16) for _ in range(2)]
        feeds = {"qkv": rng.standard_normal((1, new, (H + 2 * HKV) * D)).astype(np.float32),
                 "seqlens_k": np.array([keys - 1], np.int32), "total_sequence_length": np.array(keys, np.int32)}
        binding = session.io_binding()
        binding.bind_output("out")
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for name, array in zip(("past_key", "past_value"), cache):  # (in place, as the engines bind them)
            value = ort.OrtValue.ortvalue_from_numpy(array)
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name.replace("past", "present"), value)
        session.run_with_iobinding(binding)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            session.run_with_iobinding(binding)
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cases", default="2048:1,4096:1,16384:1,4096:256,16384:256", help="keys:new tokens, ...")
    args = parser.parse_args()
    for case in args.cases.split(","):
        keys, new = (int(x) for x in case.split(":"))
        reps = 20 if new == 1 else 3
        dense, indexed = (_time(keys, new, flag, args.threads, reps) for flag in (False, True))
        print(f"{keys:6d} keys, {new:4d} new: dense {dense:9.2f} ms, indexed {indexed:9.2f} ms "
              f"({indexed / dense:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
