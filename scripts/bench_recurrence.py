"""llmc's GatedDeltaRule on the recurrent layers' published shapes: one decode step (1 and 8 rows) and a prompt.

    python scripts/bench_recurrence.py [--threads 2] [--prompt 512] [--rounds 7]

Three layers, one each: Mamba-2 (`delta` 0: 128 heads of 64 over a state of 128, one group of B and C), Qwen3.5's
Gated DeltaNet (16 key / 32 value heads of 128 x 128) and Kimi Delta Attention (32 heads of 128 x 128, a decay per
key dim). Prints each call's median and best milliseconds, the prompt's GFLOP/s (5 flops a state element and token
for Mamba-2's rule, 7 for the delta rule, as the kernels do them) and a decode step's state traffic (each row's state
read and written once).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from llmc.engines.kernels import library_path

NAMES = ("q", "k", "v", "g", "beta", "state")
# name, delta rule, (key heads, value heads, key dim, value dim), a decay per key dim
LAYERS = (("Mamba-2", False, (1, 128, 128, 64), False), ("Gated DeltaNet", True, (16, 32, 128, 128), False),
          ("Kimi Delta Attention", True, (32, 32, 128, 128), True))


def _session(delta: bool, threads: int) -> ort.InferenceSession:
    node = helper.make_node("GatedDeltaRule", list(NAMES), ["out", "state_out"], domain="ai.llmc",
                            **({} if delta else {"delta": 0}))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in NAMES]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "state_out")]
    model = helper.make_model(helper.make_graph([node], "recurrence", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(rows: int, tokens: int, dims: tuple[int, int, int, int], per_key: bool) -> dict[str, np.ndarray]:
    hk, hv, dk, dv = dims
    rng = np.random.default_rng(0)
    return {"q": 0.1 * rng.standard_normal((rows, tokens, hk, dk), np.float32),
            "k": 0.1 * rng.standard_normal((rows, tokens, hk, dk), np.float32),
            "v": rng.standard_normal((rows, tokens, hv, dv), np.float32),
            "g": -0.1 * np.abs(rng.standard_normal((rows, tokens, hv, *((dk,) if per_key else ())), np.float32)),
            "beta": rng.uniform(0, 1, (rows, tokens, hv)).astype(np.float32),
            "state": np.zeros((rows, hv, dk, dv), np.float32)}


def _timed(session: ort.InferenceSession, feeds: dict[str, np.ndarray], rounds: int, calls: int) -> list[float]:
    session.run(None, feeds)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            session.run(None, feeds)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for name, delta, dims, per_key in LAYERS:
        session = _session(delta, args.threads)
        hv, dk, dv = dims[1:]
        for rows, tokens in ((1, 1), (8, 1), (1, args.prompt)):
            times = _timed(session, _feeds(rows, tokens, dims, per_key), args.rounds, 10 if tokens == 1 else 1)
            best = min(times)
            state = rows * hv * dk * dv * 4
            what = (f"{rows * tokens * hv * dk * dv * (7 if delta else 5) / best / 1e6:.0f} GFLOP/s" if tokens > 1
                    else f"{2 * state / best / 1e6:.1f} GB/s of state")
            print(f"{name}: {rows} row(s) x {tokens} token(s): {float(np.median(times)):.3f} ms "
                  f"(best {best:.3f}), {what}, state {state / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
