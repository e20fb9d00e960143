"""llmc's GatedDeltaRule on the recurrent layers' published shapes: one decode step (1 and 8 rows) and a prompt.

    python scripts/bench_recurrence.py [--threads 2] [--prompt 512] [--rounds 7]

Four layers, one each: Mamba-2 (`delta` 0: 128 heads of 64 over a state of 128, one group of B and C), Qwen3.5's
Gated DeltaNet (16 key / 32 value heads of 128 x 128), Kimi Delta Attention (32 heads of 128 x 128, a decay per
key dim) and Mamba-1's selective scan (Falcon Mamba 7B's: 8,192 channels as 128 heads of 64 over a state of 16, a
decay per element: the optional input A). Prints each call's median and best milliseconds, the prompt's GFLOP/s (5
flops a state element and token for Mamba-2's rule, 7 for the delta rule, 5 and an exponential for the scan, as the
kernels do them) and a decode step's state traffic (each row's state read and written once).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from llmc.engines.kernels import library_path

NAMES = ("q", "k", "v", "g", "beta", "state")
# name, delta rule, (key heads, value heads, key dim, value dim), g's form ("head", "key": one a key dim, "scan": g and
# beta one a value dim, and A)
LAYERS = (("Mamba-2", False, (1, 128, 128, 64), "head"), ("Gated DeltaNet", True, (16, 32, 128, 128), "head"),
          ("Kimi Delta Attention", True, (32, 32, 128, 128), "key"), ("Mamba-1 scan", False, (1, 128, 16, 64), "scan"))


def _session(delta: bool, threads: int, scan: bool) -> ort.InferenceSession:
    names = [*NAMES, "", "A"] if scan else list(NAMES)
    node = helper.make_node("GatedDeltaRule", names, ["out", "state_out"], domain="ai.llmc",
                            **({} if delta else {"delta": 0}))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names if n]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "state_out")]
    model = helper.make_model(helper.make_graph([node], "recurrence", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(library_path()))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _feeds(rows: int, tokens: int, dims: tuple[int, int, int, int], form: str) -> dict[str, np.ndarray]:
    hk, hv, dk, dv = dims
    rng = np.random.default_rng(0)
    feeds = {"q": 0.1 * rng.standard_normal((rows, tokens, hk, dk), np.float32),
             "k": 0.1 * rng.standard_normal((rows, tokens, hk, dk), np.float32),
             "v": rng.standard_normal((rows, tokens, hv, dv), np.float32),
             "g": -0.1 * np.abs(rng.standard_normal((rows, tokens, hv, *((dk,) if form == "key" else ())), np.float32)),
             "beta": rng.uniform(0, 1, (rows, tokens, hv)).astype(np.float32),
             "state": np.zeros((rows, hv, dk, dv), np.float32)}
    if form == "scan":  # dt (softplus: positive) as g and beta, one a channel; A = -exp(A_log) [heads, state, dim]
        feeds["g"] = feeds["beta"] = rng.uniform(0.01, 1.0, (rows, tokens, hv, dv)).astype(np.float32)
        feeds["A"] = -np.tile(np.arange(1, dk + 1, dtype=np.float32)[None, :, None], (hv, 1, dv))
    return feeds


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
    for name, delta, dims, form in LAYERS:
        session = _session(delta, args.threads, form == "scan")
        hv, dk, dv = dims[1:]
        for rows, tokens in ((1, 1), (8, 1), (1, args.prompt)):
            times = _timed(session, _feeds(rows, tokens, dims, form), args.rounds, 10 if tokens == 1 else 1)
            best = min(times)
            state = rows * hv * dk * dv * 4
            what = (f"{rows * tokens * hv * dk * dv * (7 if delta else 5) / best / 1e6:.0f} GFLOP/s" if tokens > 1
                    else f"{2 * state / best / 1e6:.1f} GB/s of state")
            print(f"{name}: {rows} row(s) x {tokens} token(s): {float(np.median(times)):.3f} ms "
                  f"(best {best:.3f}), {what}, state {state / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
