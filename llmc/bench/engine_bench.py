"""`llmc bench ENGINE_DIR`: time to first token, per-token latency and decode throughput of an engine, judged
against the memory-bandwidth limit of the machine (and, optionally, transformers measured in the same run)."""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmc.bench.bandwidth import probe as probe_bandwidth
from llmc.bench.constrained import constrained_report, grammar_times, timed_sampler
from llmc.bench.limits import (
    DEFAULT_BANDWIDTH_GBS,
    host_cpu,
    kv_bytes_copied_per_step,
    matrix_peak,
    prefill_flops,
    weight_bytes_per_step,
    weights_class,
)
from llmc.engines.host_kv import memory_limit
from llmc.errors import InputError
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.generator import EngineLoop
from llmc.runtime.llm import LLM
from llmc.runtime.request import SamplingParams

if TYPE_CHECKING:
    from llmc.bench.torch_ref import TorchPeer

FILLER = ("The history of the city goes back many centuries, with markets, bridges, libraries and gardens that "
          "travellers described in letters, songs and careful maps. ")


def kv_bytes_for(bytes_per_token: int, block: int, batch: int, longest: int) -> int:
    """The KV memory a batch of `batch` rows of `longest` positions needs in blocks of `block` tokens (0: the slot
    layout): every row's blocks, and one block more a row, as the scheduler admits a prompt only while a block of
    headroom a running row stays free (a bitnet-2B-shaped engine's 8 rows of 96 + 32 tokens in blocks of 64: 6 ran
    on the rows' tokens alone)."""
    block = block or 1
    return bytes_per_token * batch * (-(-(longest + 8) // block) + 1) * block


@dataclass(frozen=True)
class BenchConfig:
    engine_dir: Path
    batch_sizes: tuple[int, ...] = (1, 8)
    prompt_len: int = 128
    new_tokens: int = 128
    contexts: tuple[int, ...] = ()  # extra batch-1 runs with these prompt lengths (decode speed vs context)
    threads: int = 0
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS
    repeat: int = 3  # timed runs per configuration; the median run (by decode speed) is reported
    against: Path | None = None  # a second engine, run right after this one in every round (its rows follow)
    # each configuration also runs constrained to this schema, right after the plain run (greedy, EOS ignored
    # until the schema's end): its decode speed against the plain run's is the cost of constrained decoding
    json_schema: dict[str, Any] | None = None

    def check(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise InputError(f"--batch-sizes must be >= 1, got {list(self.batch_sizes)}")
        if self.prompt_len < 1 or self.new_tokens < 2:
            raise InputError(f"--prompt-len must be >= 1 and --new-tokens >= 2, got {self.prompt_len}, {self.new_tokens}")
        if self.repeat < 1:
            raise InputError(f"--repeat must be >= 1, got {self.repeat}")
        if any(c < 1 for c in self.contexts):
            raise InputError(f"--contexts must be >= 1, got {list(self.contexts)}")
        if not 0 < self.bandwidth_gbs < math.inf:
            raise InputError(f"--bandwidth-gbs must be a finite number > 0, got {self.bandwidth_gbs:g}")

    def runs(self) -> list[tuple[int, int, int]]:
        """(batch, prompt_len, new_tokens) of every measured configuration."""
        runs = [(b, self.prompt_len, self.new_tokens) for b in self.batch_sizes]
        return runs + [(1, c, min(self.new_tokens, 64)) for c in self.contexts if (1, c) not in
                       {(b, p) for b, p, _ in runs}]


def synthetic_prompts(llm: LLM, batch: int, length: int) -> list[list[int]]:
    """`batch` different prompts of exactly `length` tokens (rows start at different offsets of a fixed text)."""
    ids = llm.tokenizer.encode(FILLER * (length // 8 + 4), add_special_tokens=False)
    while len(ids) < length + batch:
        ids = ids + ids
    return [ids[row : row + length] for row in range(batch)]


def measure(loop: EngineLoop, prompts: list[list[int]], new_tokens: int,
            json_schema: dict[str, Any] | None = None) -> dict[str, float]:
    """Run one batch to full length (EOS ignored); TTFT is the prefill step, ITL each decode step. Constrained to
    `json_schema`, a row ends with the schema (it may end early): only the steps that decode every row are timed,
    so that a shrinking batch does not look faster."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, json_schema=json_schema)
    rids = [loop.add_request(p, params) for p in prompts]
    with timed_sampler(loop) as sampler:
        timing = _timed_steps(loop, len(prompts))
    masks = grammar_times(loop, rids)
    lengths = [len(loop.pop(rid).outputs[0].token_ids) for rid in rids]
    assert json_schema is not None or lengths == [new_tokens] * len(prompts), lengths
    if "tpot_ms" not in timing and json_schema is not None:
        raise InputError(f"the constrained run generated {min(lengths)} token(s): give --json-schema a schema "
                         "whose answers take many tokens (e.g. an array with minItems)")
    assert "tpot_ms" in timing, "no decode step ran every row of the batch"  # (the budget above admits them all)
    per_step = 1e3 / timing.pop("num_steps")
    return {**timing, "tokens": float(np.mean(lengths)), "sampler_ms": sampler.seconds * per_step,
            "mask_wait_ms": masks[0] * per_step, "mask_cpu_ms": masks[1] * per_step}


def _timed_steps(loop: EngineLoop, batch: int) -> dict[str, float]:
    """Step until done: TTFT (the first step) and the decode steps that ran every row of the batch."""
    start = time.perf_counter()
    loop.step()  # every prompt fits the step budget: one prefill step, first token of each row
    ttft = time.perf_counter() - start
    steps, num_steps = [], 1
    while loop.has_work:
        full = loop.stats().running == batch
        t0 = time.perf_counter()
        loop.step()
        num_steps += 1
        if full:
            steps.append(time.perf_counter() - t0)
    if not steps:
        return {"ttft_ms": ttft * 1e3, "num_steps": num_steps}
    itl = np.array(steps) * 1e3
    return {"ttft_ms": ttft * 1e3, "tpot_ms": float(itl.mean()), "itl_ms_median": float(np.median(itl)),
            "itl_ms_p90": float(np.percentile(itl, 90)), "itl_ms_p99": float(np.percentile(itl, 99)),
            "num_steps": num_steps}


def run_bench(cfg: BenchConfig, on_progress: Callable[[], None] | None = None,
              compare_torch: bool = False) -> list[dict[str, Any]]:
    """Measure every configuration `cfg.repeat` times, the repeats interleaved (configuration 1, 2, ..., 1, 2, ...)
    so that a drift of the machine's speed during the run reaches every configuration alike and the ratios between
    them (batch 8 vs 1, context 2048 vs 128) stay fair; each configuration reports its median run. With
    `compare_torch`, transformers runs each configuration's prompts right after each of the engine's runs of it
    (in a child process), and the ratio is between the two medians. With `cfg.against`, a second engine runs each
    configuration right after the first in every round: its rows follow the first engine's, which carry the ratios
    (`decode_vs_against`, `ttft_vs_against`)."""
    cfg.check()
    with ExitStack() as stack:
        llm = LLM(cfg.engine_dir, RuntimeConfig(threads=cfg.threads, max_running=1))
        other = None if cfg.against is None else LLM(cfg.against, RuntimeConfig(threads=cfg.threads, max_running=1))
        peer = None
        if compare_torch:
            from llmc.bench.torch_ref import TorchPeer
            from llmc.manifest import load_export

            peer = stack.enter_context(TorchPeer(load_export(llm.engine.manifest.export_dir).source,
                                                 llm.engine.threads))
        return _run_bench(cfg, llm, other, peer, on_progress)


@dataclass
class _Bench:
    """One engine under measurement: its loop, prompts and each configuration's timed runs."""

    llm: LLM
    directory: Path
    loop: EngineLoop
    weights: int
    prompts: dict[tuple[int, int, int], list[list[int]]]
    timings: dict[tuple[int, int, int], list[dict[str, float]]]
    json_schema: dict[str, Any] | None = None
    constrained: dict[tuple[int, int, int], list[dict[str, float]]] | None = None

    @classmethod
    def of(cls, llm: LLM, directory: Path, runs: list[tuple[int, int, int]],
           json_schema: dict[str, Any] | None = None) -> _Bench:
        max_batch = max(b for b, _, _ in runs)
        longest = max(p + n for _, p, n in runs)
        if longest > llm.engine.max_positions:
            raise InputError(f"the longest run needs {longest} positions, {directory} allows "
                             f"{llm.engine.max_positions}")
        need, limit = kv_bytes_for(llm.engine.kv_bytes_per_token(), llm.engine.kv_block_size, max_batch,
                                   longest), memory_limit()
        if need > limit:
            raise InputError(f"--batch-sizes {max_batch} at {longest} positions needs {need / 2**20:,.0f} MiB of KV "
                             f"memory, more than this machine's {limit / 2**20:,.0f} MiB")
        budget = need // 2**20 + 1
        # no prefix caching: every run's prompts are the warm-up's, and TTFT is the prompts' prefill, computed
        loop = EngineLoop(llm.engine, llm.tokenizer, RuntimeConfig(max_running=max_batch, kv_budget_mb=budget,
                                                                   max_step_tokens=max_batch * longest + max_batch,
                                                                   prefix_caching=False))
        if loop.max_len < longest:
            raise InputError(f"the longest run needs {longest} positions, {directory} allows {loop.max_len}")
        return cls(llm, directory, loop, weight_bytes_per_step(directory, llm.engine.manifest),
                   {run: synthetic_prompts(llm, run[0], run[1]) for run in runs}, {run: [] for run in runs},
                   json_schema, None if json_schema is None else {run: [] for run in runs})

    def measure(self, run: tuple[int, int, int], first_round: bool) -> None:
        if first_round:  # warm-up at this shape: the runtime's first-run allocations are not timed
            measure(self.loop, self.prompts[run], 2)
            if self.json_schema is not None:  # and the schema compiled (once: later runs find it cached)
                measure(self.loop, self.prompts[run], 4, self.json_schema)
        self.timings[run].append(measure(self.loop, self.prompts[run], run[2]))
        if self.constrained is not None:
            self.constrained[run].append(measure(self.loop, self.prompts[run], run[2], self.json_schema))
        if first_round:  # the process's peak so far, the configurations' first runs in their order
            self.timings[run][0]["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def result(self, cfg: BenchConfig, run: tuple[int, int, int]) -> dict[str, Any]:
        runs_t = sorted(self.timings[run], key=lambda t: t["tpot_ms"])
        timing = {**runs_t[len(runs_t) // 2], "tpot_ms_best": runs_t[0]["tpot_ms"],
                  "tpot_ms_worst": runs_t[-1]["tpot_ms"], "peak_rss_mb": self.timings[run][0]["peak_rss_mb"]}
        row = {"engine": str(self.directory), **_report(self.llm, cfg, *run, timing, self.weights)}
        if self.constrained is not None:
            row.update(constrained_report(self.constrained[run], self.timings[run]))
        return row


def _run_bench(cfg: BenchConfig, llm: LLM, other: LLM | None, peer: TorchPeer | None,
               on_progress: Callable[[], None] | None) -> list[dict[str, Any]]:
    runs = cfg.runs()
    benches = [_Bench.of(llm, cfg.engine_dir, runs, cfg.json_schema)]
    if other is not None and cfg.against is not None:
        benches.append(_Bench.of(other, cfg.against, runs))
    # the host's read bandwidth (what a CPU engine's step is bound by) before the first round and after every round,
    # so each round's decode is set against what the machine read around it (a shared VM's bandwidth moves from one
    # minute to the next: 27-56 GB/s within half an hour on the EPYC VM of 2026-12-04)
    on_cpu = llm.engine.manifest.backend == "ort"
    bandwidth = [probe_bandwidth(llm.engine.threads)] if on_cpu else []
    # what the prompts' products could reach, for each engine's weights (fp32, bf16 or int8 instructions), at the
    # start and the end of the run (the higher counts: a shared machine's speed moves from minute to minute)
    classes = {weights_class(b.llm.engine.manifest.settings) for b in benches} if on_cpu else set()
    peaks = {cls: [matrix_peak(llm.engine.threads, cls)] for cls in classes}
    peer_timings: dict[tuple[int, int, int], list[dict[str, float]]] = {run: [] for run in runs}
    for first_round in [True] + [False] * (cfg.repeat - 1):
        for run in runs:
            for bench in benches:
                bench.measure(run, first_round)
            if peer is not None:
                peer_timings[run].append(peer.measure(benches[0].prompts[run], run[2]))
            if on_progress:
                on_progress()
        if on_cpu:
            bandwidth.append(probe_bandwidth(llm.engine.threads))
    if on_cpu:
        for cls in classes:
            peaks[cls].append(matrix_peak(llm.engine.threads, cls))
    host = host_cpu() if on_cpu else {}
    per_engine = []
    for bench in benches:
        rows = []
        for run in runs:
            result = bench.result(cfg, run)
            if peer is not None and bench is benches[0]:
                result.update(against_peer(result, peer_timings[run]))
            if on_cpu:
                result.update(host)
                result.update(against_measured(result, bandwidth, cfg.bandwidth_gbs,
                                               [t["tpot_ms"] for t in bench.timings[run]]))
                manifest = bench.llm.engine.manifest
                result.update(against_matrix_peak(result, peaks[weights_class(manifest.settings)],
                                                  prefill_flops(bench.directory, manifest, run[1])))
            rows.append(result)
        add_ratios(rows, cfg.prompt_len)
        per_engine.append(rows)
    if len(per_engine) == 2:
        for mine, theirs in zip(*per_engine):
            mine["decode_vs_against"] = round(mine["decode_tok_s_per_seq"] / theirs["decode_tok_s_per_seq"], 3)
            mine["ttft_vs_against"] = round(theirs["ttft_ms"] / mine["ttft_ms"], 3)
    return [r for rows in per_engine for r in rows]


def against_peer(result: dict[str, Any], runs: list[dict[str, float]]) -> dict[str, Any]:
    """transformers' median run of this configuration (by decode speed), its range, and the engine's ratios."""
    speeds = sorted(runs, key=lambda r: r["torch_decode_tok_s_per_seq"])
    median = speeds[len(speeds) // 2]
    return {"torch_ttft_ms": round(median["torch_ttft_ms"], 2),
            "torch_decode_tok_s_per_seq": round(median["torch_decode_tok_s_per_seq"], 1),
            "torch_decode_tok_s_per_seq_range": [round(speeds[i]["torch_decode_tok_s_per_seq"], 1) for i in (0, -1)],
            "speedup_vs_torch": round(result["decode_tok_s_per_seq"] / median["torch_decode_tok_s_per_seq"], 2),
            "ttft_speedup_vs_torch": round(median["torch_ttft_ms"] / result["ttft_ms"], 2)}


def against_measured(result: dict[str, Any], bandwidth: list[float | None], assumed_gbs: float,
                     tpots_ms: list[float]) -> dict[str, Any]:
    """The bandwidth this run measured (`read_bandwidth_gbs`: before the first round, then after each) and how close
    the engine came to what the hardware gave it, beside `fraction_of_limit` at the stated --bandwidth-gbs: each
    round's decode (`tpots_ms`, in round order) against the limit at the mean of the probes just before and after
    that round, and the median round's fraction and limit reported. On a shared machine the read bandwidth moves
    from minute to minute, so a probe at the run's two ends alone may miss the machine a round ran on."""
    out: dict[str, Any] = {"read_bandwidth_gbs": bandwidth}
    rounds = []
    for i, tpot in enumerate(tpots_ms):
        around = [g for g in bandwidth[i:i + 2] if g]
        if around:
            limit = result["bandwidth_limit_tok_s_per_seq"] * sum(around) / len(around) / assumed_gbs
            rounds.append((1e3 / tpot / limit, limit))
    if rounds:
        fraction, limit = sorted(rounds)[len(rounds) // 2]
        out["measured_limit_tok_s_per_seq"] = round(limit, 1)
        out["fraction_of_measured_limit"] = round(fraction, 3)
        out["fraction_of_measured_limit_rounds"] = [round(f, 3) for f, _ in rounds]
    return out


def against_matrix_peak(result: dict[str, Any], peaks: list[tuple[str, float] | None],
                        flops: float) -> dict[str, Any]:
    """The prefill's arithmetic rate (the prompts' FLOPs over TTFT) and its share of the matrix throughput this run
    measured (the higher of its start and end figures, both in `matrix_peak_gflop_s_runs`) for the instructions the
    prompts' products take (AMX-BF16 tiles, VNNI's int8 or AVX-512 BF16's dot products, or fp32 FMAs:
    limits.matrix_peak)."""
    gflops = flops * result["batch"] / (result["ttft_ms"] / 1e3) / 1e9
    out: dict[str, Any] = {"prefill_gflop_s": round(gflops, 2)}
    measured = [p for p in peaks if p is not None]
    if measured:
        best = max(p[1] for p in measured)
        out.update(matrix_peak_kind=measured[0][0], matrix_peak_gflop_s=best,
                   matrix_peak_gflop_s_runs=[p[1] for p in measured],
                   prefill_fraction_of_matrix_peak=round(gflops / best, 3))
    return out


def add_ratios(results: list[dict[str, Any]], prompt_len: int) -> None:
    """The ratios the targets are stated in, within this run: each batch's aggregate decode speed against batch 1
    (`aggregate_vs_batch1`) and each batch-1 context's decode speed against the base prompt length
    (`decode_vs_base_context`)."""
    base = next((r for r in results if r["batch"] == 1 and r["prompt_len"] == prompt_len), None)
    if base is None:
        return
    for r in results:
        if r["prompt_len"] == prompt_len:
            r["aggregate_vs_batch1"] = round(r["decode_tok_s_aggregate"] / base["decode_tok_s_aggregate"], 3)
        if r["batch"] == 1:
            r["decode_vs_base_context"] = round(r["decode_tok_s_per_seq"] / base["decode_tok_s_per_seq"], 3)


def _report(llm: LLM, cfg: BenchConfig, batch: int, prompt_len: int, new_tokens: int, t: dict[str, float],
            weights: int) -> dict[str, Any]:
    m = llm.engine.manifest
    per_token = llm.engine.kv_bytes_per_token()
    context = prompt_len + new_tokens // 2  # mean context over the decode steps
    # weights once per step + every row's KV, and its states (recurrent layers: read and written whole each step)
    step_bytes = weights + batch * (context * per_token + 2 * llm.engine.state_bytes_per_sequence())
    limit_steps = cfg.bandwidth_gbs * 1e9 / step_bytes
    steps_per_s = 1e3 / t["tpot_ms"]
    return {
        "backend": m.backend, "precision": m.precision, "kv_layout": m.kv.layout, "threads": llm.engine.threads,
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "ttft_ms": round(t["ttft_ms"], 2), "prefill_tok_s": round(batch * prompt_len / t["ttft_ms"] * 1e3, 1),
        "tpot_ms": round(t["tpot_ms"], 3), "itl_ms_median": round(t["itl_ms_median"], 3),
        "itl_ms_p90": round(t["itl_ms_p90"], 3), "itl_ms_p99": round(t["itl_ms_p99"], 3),
        "decode_tok_s_per_seq": round(steps_per_s, 1), "decode_tok_s_aggregate": round(steps_per_s * batch, 1),
        "decode_tok_s_per_seq_range": [round(1e3 / t["tpot_ms_worst"], 1), round(1e3 / t["tpot_ms_best"], 1)],
        "runs": cfg.repeat,
        "bandwidth_limit_tok_s_per_seq": round(limit_steps, 1), "fraction_of_limit": round(steps_per_s / limit_steps, 3),
        "weight_bytes_per_step": weights, "kv_bytes_copied_per_step": kv_bytes_copied_per_step(m, batch, context,
                                                                                                per_token),
        "peak_rss_mb": round(t["peak_rss_mb"], 1),
    }


def summary_line(r: dict[str, Any]) -> str:
    low, high = r["decode_tok_s_per_seq_range"]
    return (f"{r['precision']:>12} b={r['batch']:<3} p={r['prompt_len']:<5} ttft {r['ttft_ms']:8.1f} ms  "
            f"decode {r['decode_tok_s_per_seq']:7.1f} ({low:.1f}-{high:.1f}) tok/s/seq "
            f"{r['decode_tok_s_aggregate']:8.1f} agg  "
            f"{r['fraction_of_limit']:.0%} of {r['bandwidth_limit_tok_s_per_seq']:.0f} limit" + _measured_note(r)
            + _prefill_note(r) + _ratio_note(r))


def _prefill_note(r: dict[str, Any]) -> str:
    if "prefill_fraction_of_matrix_peak" not in r:
        return ""
    return (f"  prefill {r['prefill_gflop_s']:.0f} GFLOP/s, {r['prefill_fraction_of_matrix_peak']:.0%} of "
            f"{r['matrix_peak_kind']}'s {r['matrix_peak_gflop_s']:.0f}")


def _measured_note(r: dict[str, Any]) -> str:
    if "fraction_of_measured_limit" not in r:
        return ""
    return f" ({r['fraction_of_measured_limit']:.0%} of {r['measured_limit_tok_s_per_seq']:.0f} as measured)"


def _ratio_note(r: dict[str, Any]) -> str:
    note = ""
    if r["batch"] > 1 and "aggregate_vs_batch1" in r:
        note = f"  {r['aggregate_vs_batch1']:.2f}x batch 1"
    elif r["batch"] == 1 and r.get("decode_vs_base_context", 1.0) != 1.0:
        note = f"  {r['decode_vs_base_context']:.2f}x of the base context"
    if "json_schema_vs_plain" in r:
        note += (f"  | json schema {r['json_schema_decode_tok_s_per_seq']:.1f} tok/s/seq, "
                 f"{r['json_schema_vs_plain']:.2f}x plain ({r['json_schema_tokens']:.0f} tokens; adds at most "
                 f"{r['json_schema_cost_bound']:.1%} of a step: sampler {r['json_schema_sampler_ms_per_step']:.2f} vs "
                 f"{r['plain_sampler_ms_per_step']:.2f} ms, masks {r['json_schema_mask_cpu_ms_per_step']:.2f} ms CPU, "
                 f"{r['json_schema_mask_wait_ms_per_step']:.2f} ms waited)")
    if "decode_vs_against" in r:
        note += f"  | {r['decode_vs_against']:.2f}x the --against engine's decode, {r['ttft_vs_against']:.2f}x its TTFT"
    return note
