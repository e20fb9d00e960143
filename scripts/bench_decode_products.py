"""An engine's matrix products alone (its MatMulQ4/Q8/BF16 nodes in graph order, each fed its own input of M rows),
timed under several environments in alternating processes: where the weights' streaming goes, without attention,
norms, sampling or Python in between.

    python scripts/bench_decode_products.py out/int4 --rows 1 --rounds 5 --env LLMC_PREFETCH=l1 --env LLMC_PREFETCH=l2

Each round runs every configuration once, in its own process (ONNX Runtime's spinning pools of two sessions in
one process would share the cores), its session as the engine's (llmc's pool where every parallel node is llmc's;
LLMC_POOL=onnxruntime: ONNX Runtime's), for --runs runs after a warm-up; the figure per configuration is the median
of its rounds' medians, with the weight bytes a run reads and the GB/s that makes. Configurations differ only in
environment variables (LLMC_PREFETCH, LLMC_KERNELS_AVX2, ...); --library takes another build of the operator
library for every configuration instead of the installed one.

A product with a `window` (a quality-raised head: its second int8 level only for the tiles whose one-level logits lie
within the window of the row's largest) costs what its logits make it: random x spreads SmolLM2's logits over less
than the window, so every tile takes the second level and the head times ~8-10 ms at 8 rows where the engine's (a
model's peaked logits) takes between its one- and two-level times (1.3-3.4 ms, docs/performance_notes.md). The
script says so when the engine has one; compare such engines by their decode
steps (`llmc bench`), or the products without the head.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRODUCTS = ("MatMulQ4", "MatMulQ8", "MatMulBF16")


def products_model(engine: Path, rows: int, out: Path) -> tuple[list[int], int]:
    """The engine's product nodes as a model of their own at `out`; their input widths and weight bytes."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    nodes, used = [], []
    for n in model.graph.node:
        if n.op_type not in PRODUCTS:
            continue
        k = next(a.i for a in n.attribute if a.name == "K")
        node = helper.make_node(n.op_type, [f"x{k}", *n.input[1:]], [n.output[0]], name=n.name, domain=n.domain)
        node.attribute.extend(n.attribute)
        nodes.append(node)
        used += [i for i in n.input[1:] if i]
    used = list(dict.fromkeys(used))
    if not nodes:
        raise SystemExit(f"{engine}: no {', '.join(PRODUCTS)} nodes (an engine built with llmc's operators has them)")
    widths = sorted({int(n.input[0][1:]) for n in nodes})
    windowed = [n.name for n in nodes if any(a.name == "window" and a.f > 0 for a in n.attribute)]
    if windowed:
        print(f"note: windowed ({', '.join(windowed)}): the second level only near a row's largest outputs, which on "
              "random x is every tile, more than the engine's decode computes (this script's docstring)", file=sys.stderr)
    nbytes = sum(int(e.value) for u in used for e in inits[u].external_data if e.key == "length")
    graph = helper.make_graph(nodes, "products",
                              [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [rows, k]) for k in widths],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes],
                              [inits[u] for u in used])
    new = helper.make_model(graph, opset_imports=list(model.opset_import))
    new.ir_version = model.ir_version
    onnx.save(new, str(out))
    return widths, nbytes


def child(model: Path, widths: list[int], rows: int, runs: int, threads: int, library: str | None) -> None:
    """One configuration's timed runs (this process's environment): prints their median in seconds."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from llmc.engines.kernels import library_path, register
    from llmc.engines.ort.run import uses_own_pool

    # the engine's session: llmc's pool where every parallel node is llmc's (LLMC_POOL=onnxruntime: ONNX Runtime's)
    own = uses_own_pool(onnx.load(str(model), load_external_data=False), threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1 if own else threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    register(so, Path(library) if library else library_path(), threads, own_pool=own)
    session = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    feeds = {f"x{k}": np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32) for k in widths}
    for _ in range(10):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t)
    print(json.dumps({"median_s": statistics.median(times)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine", type=Path)
    p.add_argument("--rows", type=int, default=1, help="rows of x per product (the batch at decode)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--runs", type=int, default=40, help="timed runs per configuration and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                   help="one configuration's environment (repeatable; none: the environment as it is)")
    p.add_argument("--library", help="an operator library to register in place of the installed one")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        widths = json.loads(a.child)
        child(a.engine, widths, a.rows, a.runs, a.threads, a.library)
        return
    configs = [dict(kv.split("=", 1) for kv in e.split(",")) for e in a.env] or [{}]
    # beside the engine's model: ONNX Runtime reads external weights only from the model's own folder
    fd, name = tempfile.mkstemp(suffix=".products.onnx", dir=a.engine)
    os.close(fd)
    model = Path(name)
    try:
        widths, nbytes = products_model(a.engine, a.rows, model)
        medians: list[list[float]] = [[] for _ in configs]
        for _ in range(a.rounds):
            for i, env in enumerate(configs):
                cmd = [sys.executable, __file__, str(model), "--child", json.dumps(widths), "--rows", str(a.rows),
                       "--runs", str(a.runs), "--threads", str(a.threads)] + (["--library", a.library] if a.library
                                                                               else [])
                out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{env or '(as is)'}: {out.stderr.strip().splitlines()[-1]}")
                medians[i].append(json.loads(out.stdout.strip().splitlines()[-1])["median_s"])
    finally:
        model.unlink(missing_ok=True)
    for env, m in zip(configs, medians):
        med = statistics.median(m)
        name = ",".join(f"{k}={v}" for k, v in env.items()) or "(as is)"
        print(f"{name:40s} rows {a.rows}: {med * 1e3:6.2f} ms = {nbytes / med / 1e9:5.1f} GB/s over {nbytes / 1e6:.1f} MB"
              f"  (rounds: {' '.join(f'{x * 1e3:.2f}' for x in m)})")


if __name__ == "__main__":
    main()
