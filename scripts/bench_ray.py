"""Ray Serve scale-out bench: aggregate output tokens/s of 2 replicas x 1 thread against 1 replica x 2 threads,
in the same run, on one local Ray cluster (the same load, `llmc serve-bench`'s client). Not part of CI.

    .venv/bin/python scripts/bench_ray.py ENGINE_DIR [--num-prompts 64] [--max-tokens 64] [--output FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import time
from pathlib import Path

import psutil
import ray
from ray import serve

from llmc.bench.serve_client import BenchConfig, run_bench
from llmc.deploy import ray_app
from llmc.deploy.ray_settings import RayAppConfig

LAYOUTS = ((2, 1), (1, 2))  # (replicas, threads per replica): the same 2 cores either way


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-running", type=int, default=32, help="KV slots in all, split over the replicas")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    try:
        for replicas, threads in LAYOUTS:
            cfg = RayAppConfig(engine_dir=str(args.engine_dir.resolve()), replicas=replicas, threads=threads,
                               max_running=args.max_running // replicas, kv_budget_mb=1024 // replicas, model_name="bench")
            serve.run(ray_app.build_app(cfg), name=ray_app.APP_NAME, route_prefix="/", blocking=False)
            bench = BenchConfig(url=f"http://127.0.0.1:{port}", model="bench", num_prompts=args.num_prompts,
                                concurrency=args.concurrency, prompt_len=args.prompt_len, max_tokens=args.max_tokens)
            asyncio.run(run_bench(BenchConfig(**{**bench.__dict__, "num_prompts": 4})))  # warm-up
            report = asyncio.run(run_bench(bench))
            rows.append({"replicas": replicas, "threads_per_replica": threads,
                         "max_running_per_replica": args.max_running // replicas, "completed": report["completed"],
                         "failed": report["failed"], "duration_s": round(report["duration_s"], 2),
                         "output_tok_s": round(report["output_throughput"], 1),
                         "median_ttft_ms": round(report["median_ttft_ms"], 1),
                         "median_tpot_ms": round(report["median_tpot_ms"], 2)})
            print(json.dumps(rows[-1]), flush=True)
            serve.delete(ray_app.APP_NAME)
    finally:
        ray_app.shutdown()
    result = {"bench": "ray_serve_scale_out", "engine": str(args.engine_dir), "date": time.strftime("%Y-%m-%d"),
              "cpu": platform.processor() or platform.machine(), "cores": psutil.cpu_count(logical=False),
              "load": {k: getattr(args, k) for k in ("num_prompts", "concurrency", "prompt_len", "max_tokens",
                                                      "max_running")}, "rows": rows}
    print(f"{'layout':<22}{'output tok/s':>14}{'median TTFT ms':>16}{'median TPOT ms':>16}")
    for r in rows:
        print(f"{r['replicas']} replica(s) x {r['threads_per_replica']} thr{'':<4}{r['output_tok_s']:>14}"
              f"{r['median_ttft_ms']:>16}{r['median_tpot_ms']:>16}")
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
