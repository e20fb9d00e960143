#!/usr/bin/env python3
"""llmc engines and the peers a user would pick instead, timed on the same prompts in the same run.

    scripts/compare_peers.py ENGINE [ENGINE ...] --peer ortgenai:int4 --peer openvino:int4 [--rounds 2]

The peers are installed and their models prepared by `../shared/peers/setup.sh` (ONNX Runtime GenAI, and with
BUILD_OV=1 OpenVINO GenAI, with BUILD_LLAMA=1 llama.cpp); each is timed by its own script there, in its own venv
and process, the way that script documents (the same 128-token chat prompt ids for every tool, 128 new tokens with
EOS masked, greedy, 2 threads, batch 1 and 8, 1 warm-up + `--reps` timed runs, the median). The llmc engines are
timed here the same way on the same ids (TTFT = the prefill and the first token's greedy pick; decode = the other
new-1 steps), each in a child process too. `--rounds` passes go round every tool in turn, so a drift of the
machine's speed reaches all of them alike; the figures are the medians over the rounds, and every row carries
its ratios to the first llmc engine of the same batch. Output: a table, and with `--json FILE` one object per
(tool, precision, batch) row.

Peers: ortgenai:fp32|int4, openvino:fp32|int8|int4 (its default: bf16 compute on CPUs that have it),
llamacpp:q4_1 (the GGUF as it ships).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = {  # name: (venv python, script, how the script is told the precision)
    "ortgenai": ("/tmp/anchors-venv/bin/python", "ortgenai_baseline.py", "--precisions"),
    "openvino": ("/tmp/ov-venv/bin/python", "openvino_baseline.py", "--precisions"),
    "llamacpp": ("/tmp/anchors-venv/bin/python", "llamacpp_baseline.py", None),
}
PROMPTS = Path("/tmp/anchors-data/prompt_ids.json")


def llmc_child(engine_dir: str, batch: int, new: int, reps: int, threads: int, prompts: Path = PROMPTS) -> dict:
    """One llmc engine, one batch size, timed as the peers' scripts time themselves."""
    import numpy as np

    from llmc.engines.base import EngineOptions
    from llmc.engines.registry import load_engine_dir

    rows = json.loads(prompts.read_text())["rows"][:batch]
    engine = load_engine_dir(engine_dir, EngineOptions(threads=threads))
    slots = list(range(batch))

    # the KV memory once, as llmc's runtime holds it (and its pages mapped: a cache made afresh for each run paid
    # the first write of every page inside the timed steps, up to ~10 % of batch 1 on the EPYC VM: docs/performance_notes.md, s42)
    kv = engine.new_kv_cache(batch, len(rows[0]) + new)
    kv.prefault()

    def one() -> dict:
        for slot in slots:
            kv.free(slot)
        t0 = time.perf_counter()
        tokens = np.argmax(engine.prefill(slots, [list(r) for r in rows], kv), -1)
        t1 = time.perf_counter()
        for _ in range(new - 1):
            tokens = np.argmax(engine.decode(slots, [[int(t)] for t in tokens], kv), -1)
        t2 = time.perf_counter()
        return {"ttft_s": t1 - t0, "decode_s": t2 - t1}

    one()  # warm-up
    runs = [one() for _ in range(reps)]
    ttft = statistics.median(r["ttft_s"] for r in runs) * 1000
    per_seq = statistics.median((new - 1) / r["decode_s"] for r in runs)
    return {"batch": batch, "ttft_ms": round(ttft, 2), "decode_tok_s_per_seq": round(per_seq, 2),
            "decode_tok_s_aggregate": round(per_seq * batch, 2)}


def _run(cmd: list[str]) -> list[dict]:
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: {' '.join(cmd[:3])} failed (exit {done.returncode}): {tail}")
    out = json.loads(lines[-1])
    return out["results"] if "results" in out else [out]


def run_llmc(engine: str, batches: list[int], new: int, reps: int, threads: int, prompts: Path) -> list[dict]:
    rows = []
    for b in batches:
        rows += _run([sys.executable, str(Path(__file__).resolve()), "--child", engine, "--batch", str(b),
                      "--new", str(new), "--reps", str(reps), "--threads", str(threads), "--prompts", str(prompts)])
    return rows


def run_peer(peer: str, peers_dir: Path, batches: list[int], new: int, reps: int, threads: int) -> list[dict]:
    name, _, precision = peer.partition(":")
    python, script, precision_flag = PEERS[name]
    cmd = [python, str(peers_dir / script), "--batches", ",".join(map(str, batches)), "--new", str(new),
           "--reps", str(reps), "--threads", str(threads)]
    if precision_flag:
        cmd += [precision_flag, precision]
    return _run(cmd)


def check(args: argparse.Namespace) -> None:
    """One-line errors for what is missing, before anything is timed."""
    if not args.prompts.is_file():
        raise SystemExit(f"error: {args.prompts} is missing: run ../shared/peers/setup.sh first (it writes the "
                         "prompt ids every tool reads)")
    for engine in args.engines:
        if not (Path(engine) / "engine.json").is_file():
            raise SystemExit(f"error: {engine} is not an llmc engine folder (no engine.json)")
    for peer in args.peer:
        name = peer.partition(":")[0]
        if name not in PEERS:
            raise SystemExit(f"error: --peer {peer!r}: the peers are {', '.join(PEERS)} (as name:precision)")
        if not Path(PEERS[name][0]).is_file():
            raise SystemExit(f"error: --peer {peer}: {PEERS[name][0]} is missing: install it with "
                             "../shared/peers/setup.sh (BUILD_OV=1 for openvino, BUILD_LLAMA=1 for llamacpp)")
    if not (args.peers_dir / "benchutil.py").is_file():
        raise SystemExit(f"error: --peers-dir {args.peers_dir} does not hold the peers' scripts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="*", help="llmc engine folders")
    ap.add_argument("--peer", action="append", default=[], help="name:precision, e.g. ortgenai:int4 (repeat)")
    ap.add_argument("--peers-dir", type=Path, default=HERE.parent.parent / "shared" / "peers")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the rows here, one JSON object per line")
    ap.add_argument("--prompts", type=Path, default=PROMPTS, help="the prompt ids (the peers' scripts read theirs)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(llmc_child(args.child, args.batch, args.new, args.reps, args.threads, args.prompts)))
        return
    if not args.engines:
        raise SystemExit("error: give at least one llmc engine folder")
    check(args)
    batches = [int(b) for b in args.batches.split(",")]
    tools = [("llmc", e) for e in args.engines] + [("peer", p) for p in args.peer]
    seen: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for kind, what in tools:
            print(f"round {r + 1}/{args.rounds}: {what}", file=sys.stderr, flush=True)
            rows = run_llmc(what, batches, args.new, args.reps, args.threads, args.prompts) if kind == "llmc" else \
                run_peer(what, args.peers_dir, batches, args.new, args.reps, args.threads)
            for row in rows:
                if "error" in row:
                    raise SystemExit(f"error: {what} at batch {row.get('batch')}: {row['error']}")
                seen.setdefault((what, int(row["batch"])), []).append(row)
    table = []
    for (what, batch), rows in seen.items():
        med = {k: round(statistics.median(float(r[k]) for r in rows), 2)
               for k in ("ttft_ms", "decode_tok_s_per_seq", "decode_tok_s_aggregate")}
        table.append({"tool": what, "batch": batch, "rounds": len(rows), **med})
    for row in table:
        base = next(t for t in table if t["tool"] == args.engines[0] and t["batch"] == row["batch"])
        row["decode_vs_llmc"] = round(row["decode_tok_s_per_seq"] / base["decode_tok_s_per_seq"], 3)
        row["ttft_vs_llmc"] = round(row["ttft_ms"] / base["ttft_ms"], 3)
    print(f"{'tool':40} {'batch':>5} {'TTFT ms':>9} {'tok/s/seq':>10} {'aggregate':>10} {'x llmc':>7} {'TTFT x':>7}")
    for row in sorted(table, key=lambda t: (t["batch"], t["tool"])):
        print(f"{row['tool']:40} {row['batch']:>5} {row['ttft_ms']:>9.1f} {row['decode_tok_s_per_seq']:>10.1f} "
              f"{row['decode_tok_s_aggregate']:>10.1f} {row['decode_vs_llmc']:>7.2f} {row['ttft_vs_llmc']:>7.2f}")
    if args.json:
        from llmc.bench.limits import host_cpu

        host = {"cpu": os.uname().machine, **host_cpu()}  # the model, its ISA flags, the operators' paths
        args.json.write_text("".join(json.dumps({**row, "when": time.strftime("%Y-%m-%d %H:%M"), **host}) + "\n"
                                     for row in table))


if __name__ == "__main__":
    main()
