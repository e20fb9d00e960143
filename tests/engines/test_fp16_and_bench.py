"""fp16 exports through the in-place engine, and `llmc bench` on a tiny engine (fields, JSON, plot)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import Built
from typer.testing import CliRunner

from llmc.bench import bandwidth, engine_bench, limits
from llmc.bench.limits import matrix_peak, prefill_flops
from llmc.cli.main import app
from llmc.engines.kernels import cpu_paths
from llmc.engines.ort.build import BuildConfig, build_ort
from llmc.export.exporter import ExportConfig, export
from llmc.manifest import load_engine

BENCH_FIELDS = {"backend", "precision", "batch", "prompt_len", "new_tokens", "ttft_ms", "prefill_tok_s",
                "decode_tok_s_per_seq", "decode_tok_s_aggregate", "peak_rss_mb", "fraction_of_limit",
                "bandwidth_limit_tok_s_per_seq", "kv_bytes_copied_per_step", "itl_ms_p99", "read_bandwidth_gbs"}


def test_fp16_export_builds_and_matches_its_golden(tiny_llama: Built, tmp_path: Path) -> None:
    manifest = export(ExportConfig(str(tiny_llama.hf_dir), tmp_path / "export16", dtype="float16"))
    assert manifest.kv.dtype == "float16" and manifest.parity["top1_agreement"] == 1.0
    engine = build_ort(BuildConfig(tmp_path / "export16", tmp_path / "engine16"))
    assert engine.precision == "float16"
    assert engine.settings.parity["max_abs_diff"] < 0.05


@pytest.mark.parametrize("layout", ["gqa", "concat"])
def test_bench_json_has_every_field(tiny_llama: Built, layout: str, tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine(layout)), "--batch-sizes", "1,2",
                                      "--prompt-len", "16", "--new-tokens", "8", "--contexts", "32", "--json",
                                      "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [(r["batch"], r["prompt_len"]) for r in rows] == [(1, 16), (2, 16), (1, 32)]
    for r in rows:
        assert BENCH_FIELDS <= r.keys()
        assert r["decode_tok_s_aggregate"] == pytest.approx(r["decode_tok_s_per_seq"] * r["batch"], rel=0.01)
        assert (r["kv_bytes_copied_per_step"] == 0) == (layout == "gqa")
    base, batch2, ctx = rows
    assert base["aggregate_vs_batch1"] == 1.0 and base["decode_vs_base_context"] == 1.0
    assert batch2["aggregate_vs_batch1"] == pytest.approx(
        batch2["decode_tok_s_aggregate"] / base["decode_tok_s_aggregate"], rel=0.01)
    assert ctx["decode_vs_base_context"] == pytest.approx(
        ctx["decode_tok_s_per_seq"] / base["decode_tok_s_per_seq"], rel=0.01)
    assert "decode_vs_base_context" not in batch2 and "aggregate_vs_batch1" not in ctx
    for r in rows:  # the machine the run measured, and the paths the operators took on it
        assert r["cpu_flags"] == [f for f in limits.ISA_FLAGS if f in limits.cpu_flags()]
        assert r["kernel_paths"] == cpu_paths() and r["cpu_model"] == rows[0]["cpu_model"]
    probes = base["read_bandwidth_gbs"]  # measured in child processes before the first round and after each
    assert len(probes) == base["runs"] + 1 and min(probes) > 0.5
    for r in rows:  # the limit again at what the machine read around each round: the median round's
        rounds = r["fraction_of_measured_limit_rounds"]
        assert len(rounds) == r["runs"] and r["fraction_of_measured_limit"] == sorted(rounds)[len(rounds) // 2]
        assert any(r["measured_limit_tok_s_per_seq"] == pytest.approx(
            r["bandwidth_limit_tok_s_per_seq"] * (a + b) / 2 / 35.0, rel=0.01) for a, b in zip(probes, probes[1:]))
    for r in rows:  # the prefill's arithmetic rate, and its share of the matrix instructions' measured throughput
        flops = prefill_flops(tiny_llama.engine(layout), load_engine(tiny_llama.engine(layout)), r["prompt_len"])
        # (both rounded to 2 places: a tiny model's prefill is a few GFLOP/s)
        assert r["prefill_gflop_s"] == pytest.approx(flops * r["batch"] / r["ttft_ms"] / 1e6, rel=0.02, abs=0.006)
        if "matrix_peak_gflop_s" in r:  # (a CPU whose prompts take a portable path has no figure)
            # (an fp32 engine: ONNX Runtime's fp32 products, FMAs)
            assert r["matrix_peak_kind"] in ("avx512-fp32-fma", "avx2-fp32-fma") and r["matrix_peak_gflop_s"] > 1
            # measured at the start and the end of the run: the higher counts
            assert len(r["matrix_peak_gflop_s_runs"]) == 2 and r["matrix_peak_gflop_s"] == max(
                r["matrix_peak_gflop_s_runs"])
            assert r["prefill_fraction_of_matrix_peak"] == pytest.approx(
                r["prefill_gflop_s"] / r["matrix_peak_gflop_s"], abs=2e-3)
    assert plot.stat().st_size > 1000


def test_prefill_flops_counts_each_token_s_layers_the_head_once_and_causal_attention(tiny_llama: Built) -> None:
    engine = tiny_llama.engine("gqa")
    manifest = load_engine(engine)
    m = manifest.model
    per_token = m.num_layers * m.hidden_size * ((m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                                                + m.num_heads * m.head_dim + 3 * m.intermediate_size)
    for p in (1, 5, 16):
        attention = 4 * m.num_layers * m.num_heads * m.head_dim * p * (p + 1) // 2
        want = 2 * (per_token * p + m.hidden_size * m.vocab_size) + attention
        assert prefill_flops(engine, manifest, p) == pytest.approx(want, rel=1e-9)


BF16_PEAKS = {"amx-bf16": "amx-bf16", "avx512-bf16": "avx512-bf16", "avx512f-widened": "avx512-fp32-fma",
              "avx2-widened": "avx2-fp32-fma", "portable": None}


@pytest.mark.parametrize("force", [{}, {"LLMC_KERNELS_NO_AMX": "1"}, {"LLMC_KERNELS_NO_BF16": "1"},
                                   {"LLMC_KERNELS_AVX2": "1"}, {"LLMC_KERNELS_GENERIC": "1"}])
def test_the_matrix_peak_is_that_of_the_instructions_each_precision_s_products_take(
        monkeypatch: pytest.MonkeyPatch, force: dict[str, str]) -> None:
    """int4 / int8 engines' prompts: AMX-BF16 tiles or VNNI's int8 dot products (MatMulQ4's path); bf16 engines':
    MatMulBF16's path (AMX, AVX-512 BF16, or FMAs on its widened weights); fp32 engines': ONNX Runtime's FMAs (which
    the operators' environment switches do not move); none where the path is portable C."""
    from llmc.engines.kernels import cpu_paths

    for name, value in force.items():
        monkeypatch.setenv(name, value)
    paths = cpu_paths()
    peaks = {cls: matrix_peak(2, cls, repeats=1) for cls in ("int", "bf16", "fp32")}
    kinds = {cls: peak[0] if peak else None for cls, peak in peaks.items()}
    assert kinds["int"] == {"avx512-vnni+amx-bf16": "amx-bf16", "avx512-vnni": "avx512-vnni-int8"}.get(
        paths["matmul_q4"])
    assert kinds["bf16"] == BF16_PEAKS[paths["matmul_bf16"]]
    flags = limits.cpu_flags()
    assert kinds["fp32"] == ("avx512-fp32-fma" if "avx512f" in flags else
                             "avx2-fp32-fma" if {"avx2", "fma"} <= flags else None)
    for peak in peaks.values():  # (how the rates compare is a benchmark's to say: one measurement each, on a VM
        assert peak is None or peak[1] > 10  # shared with others, read VNNI at 83 GFLOP/s and FMAs at 175 once)


def test_an_engine_s_weights_pick_its_class() -> None:
    from llmc.bench.limits import weights_class
    from llmc.manifest import EngineSettings

    assert weights_class(EngineSettings(quant="int4")) == "int"
    assert weights_class(EngineSettings(quant="int8", dtype="float32")) == "int"
    assert weights_class(EngineSettings(dtype="bfloat16")) == "bf16"
    assert weights_class(EngineSettings(dtype="float32")) == "fp32"
    assert weights_class(EngineSettings()) == "fp32"


def test_bench_interleaves_the_repeats(tiny_llama: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed repeats go round the configurations in turn (each warmed up before its first), so a drift in the
    machine's speed reaches each alike."""
    order: list[tuple[int, int, int]] = []
    real = engine_bench.measure

    def recording(loop: object, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        order.append((len(prompts), len(prompts[0]), new_tokens))
        return real(loop, prompts, new_tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_bench, "measure", recording)
    cfg = engine_bench.BenchConfig(tiny_llama.engine_dir, (1, 2), 16, 8, (32,), repeat=2)
    results = engine_bench.run_bench(cfg)
    timed = [(1, 16, 8), (2, 16, 8), (1, 32, 8)]
    assert order == [x for b, p, n in timed for x in ((b, p, 2), (b, p, n))] + timed  # warm-up before the first
    assert [(r["batch"], r["prompt_len"]) for r in results] == [(b, p) for b, p, _ in timed]


def test_bench_prefills_every_run_in_full(tiny_llama: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run's prompts are the warm-up's: with prefix caching on, every TTFT after the first would be the prefill of
    one block's remainder (measured on SmolLM2 int4: 20 ms where the whole prompt takes ~100)."""
    hits: list[int] = []
    real = engine_bench.measure

    def recording(loop: object, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        result = real(loop, prompts, new_tokens)  # type: ignore[arg-type]
        hits.append(loop.stats().prefix_hit_tokens)  # type: ignore[attr-defined]
        return result

    monkeypatch.setattr(engine_bench, "measure", recording)
    paged = tiny_llama.engine("llmc")
    assert json.loads((paged / "engine.json").read_text())["kv"]["paged"]
    engine_bench.run_bench(engine_bench.BenchConfig(paged, (1, 2), 64, 4, repeat=2))
    assert len(hits) == 6 and hits == [0] * 6


@pytest.mark.parametrize(("block", "batch", "prompt", "new"), [(64, 8, 96, 32), (64, 4, 200, 8), (16, 8, 128, 128),
                                                               (64, 1, 64, 64)])
def test_the_bench_s_kv_budget_admits_its_whole_batch(block: int, batch: int, prompt: int, new: int) -> None:
    """The scheduler admits a prompt while a block of headroom a running row stays free (scheduler.decode_headroom):
    the bench's budget (whole MiB, as it asks for it) lets every row in, and each grows to its length."""
    from llmc.runtime.block_manager import BlockManager

    per_token = 40960  # (a bitnet-2B-shaped engine of 8 layers: 5 KV heads of 128, fp32)
    budget_mb = engine_bench.kv_bytes_for(per_token, block, batch, prompt + new) // 2**20 + 1
    blocks = BlockManager(budget_mb * 2**20 // (per_token * block), block)
    tables = []
    for row in range(batch):
        got = blocks.admit(list(range(1000 * row, 1000 * row + prompt)), headroom=row)
        assert got is not None, f"row {row} of {batch} not admitted"
        tables.append(got[0])
    assert blocks.num_free >= batch * (blocks.blocks_for(prompt + new) - blocks.blocks_for(prompt))


def test_bench_timed_runs_write_only_kv_blocks_written_before(tiny_llama: Built,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first round every run reuses blocks earlier runs wrote (their pages mapped, as a server's are): a
    free queue cycled through the whole pool, and each timed run paid the first write of fresh pages."""
    from llmc.runtime.block_manager import BlockManager

    taken: set[int] = set()
    fresh: list[int] = []  # per measured run (warm-ups included): blocks no run had taken before
    real_take, real_measure = BlockManager._take, engine_bench.measure

    def take(self: BlockManager) -> int:
        block = real_take(self)
        if block not in taken:
            taken.add(block)
            fresh[-1] += 1
        return block

    def recording(loop: object, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        fresh.append(0)
        return real_measure(loop, prompts, new_tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(BlockManager, "_take", take)
    monkeypatch.setattr(engine_bench, "measure", recording)
    engine_bench.run_bench(engine_bench.BenchConfig(tiny_llama.engine("llmc"), (1, 4), 64, 8, contexts=(200,),
                                                    repeat=3))
    # round 1: each configuration's warm-up then its run; rounds 2 and 3: the runs
    assert len(fresh) == 12 and sum(fresh[:6]) > 0 and fresh[6:] == [0] * 6, fresh


def test_bench_against_a_second_engine_alternates_them_and_gives_the_ratios(
        tiny_llama: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[object] = []
    real = engine_bench.measure

    def recording(loop: object, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        if new_tokens > 2:
            order.append(loop.engine.directory)  # type: ignore[attr-defined]
        return real(loop, prompts, new_tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_bench, "measure", recording)
    other = tiny_llama.engine("llmc")
    cfg = engine_bench.BenchConfig(tiny_llama.engine_dir, (1, 2), 16, 8, repeat=2, against=other)
    rows = engine_bench.run_bench(cfg)
    assert order == [tiny_llama.engine_dir, other] * 4  # each configuration: this engine, then the other
    assert [(r["engine"], r["batch"]) for r in rows] == [(str(tiny_llama.engine_dir), 1),
                                                         (str(tiny_llama.engine_dir), 2), (str(other), 1), (str(other), 2)]
    for mine, theirs in zip(rows[:2], rows[2:]):
        assert mine["decode_vs_against"] == pytest.approx(
            mine["decode_tok_s_per_seq"] / theirs["decode_tok_s_per_seq"], abs=2e-3)
        assert mine["ttft_vs_against"] == pytest.approx(theirs["ttft_ms"] / mine["ttft_ms"], abs=2e-3)
    assert "decode_vs_against" not in rows[2]


def test_bench_rejects_bad_values(tiny_llama: Built) -> None:
    result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine_dir), "--batch-sizes", "0"])
    assert result.exit_code == 1 and "--batch-sizes must be >= 1" in result.stderr
    result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine_dir), "--batch-sizes", "a,b"])
    assert result.exit_code == 1 and "comma-separated integers" in result.stderr
    for value in ("0", "-5"):  # the limits divide by it
        result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine_dir), "--bandwidth-gbs", value])
        assert result.exit_code == 1 and f"--bandwidth-gbs must be a finite number > 0, got {value}" in result.stderr
    result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine_dir), "--threads", "-1"])
    assert result.exit_code == 1 and "--threads must be >= 0 (0 = physical cores), got -1" in result.stderr


def test_bandwidth_probe_measures_in_a_child_process(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bandwidth.measure_read_gbs(1, mib=16, repeats=2) > 0.5
    assert (bandwidth.probe(1) or 0) > 0.5
    monkeypatch.setattr(bandwidth.sys, "executable", "/nonexistent/python")
    assert bandwidth.probe(1) is None  # the bench goes on without the figure


def test_the_read_probe_streams_with_wide_loads_and_falls_back_to_onnx_runtime(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    from llmc.engines import kernels

    fn = ctypes.CDLL(str(kernels.library_path())).llmc_read_gbs
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    assert fn(2, 64 * 2**20, 3) > 0.5
    assert fn(0, 64 * 2**20, 3) == fn(1, 100, 3) == fn(1, 2**20, 0) == -1.0  # bad arguments: no figure
    monkeypatch.setenv("LLMC_KERNELS_GENERIC", "1")  # the portable loop
    assert fn(1, 16 * 2**20, 2) > 0.5
    monkeypatch.delenv("LLMC_KERNELS_GENERIC")
    assert bandwidth.ort_read_gbs(1, mib=16, repeats=2) > 0.5
    monkeypatch.setattr(kernels, "library_path", lambda: (_ for _ in ()).throw(
        kernels.BackendUnavailableError("not built")))
    calls: list[int] = []
    monkeypatch.setattr(bandwidth, "ort_read_gbs", lambda t, m, r: calls.append(t) or 7.0)
    assert bandwidth.measure_read_gbs(2, mib=16, repeats=2) == 7.0 and calls == [2]  # no library: ReduceSum


def test_bench_text_output_names_the_bandwidth(tiny_llama: Built) -> None:
    result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine_dir), "--batch-sizes", "1",
                                      "--prompt-len", "8", "--new-tokens", "4", "--repeat", "1"])
    assert result.exit_code == 0, result.output
    assert "limits use 35 GB/s" in result.stdout and "GB/s before the first round and after each" in result.stdout


def test_bench_probes_the_host_bandwidth_only_for_cpu_engines(tiny_llama: Built,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU engine's step is not bound by the host's memory: no probe, no field (an ort engine relabelled)."""
    real_llm = engine_bench.LLM

    def relabelled(*args: object, **kwargs: object) -> object:
        llm = real_llm(*args, **kwargs)  # type: ignore[arg-type]
        llm.engine.manifest = dataclasses.replace(llm.engine.manifest, backend="trt")
        return llm

    def no_probe(threads: int) -> float:
        raise AssertionError("probed the host bandwidth for a GPU engine")

    monkeypatch.setattr(engine_bench, "LLM", relabelled)
    monkeypatch.setattr(engine_bench, "probe_bandwidth", no_probe)
    rows = engine_bench.run_bench(engine_bench.BenchConfig(tiny_llama.engine_dir, (1,), 8, 4, repeat=1))
    assert rows[0]["backend"] == "trt" and "read_bandwidth_gbs" not in rows[0]


def test_bench_compares_with_transformers_run_after_each_engine_run(tiny_llama: Built) -> None:
    result = CliRunner().invoke(app, ["bench", str(tiny_llama.engine_dir), "--batch-sizes", "1,2", "--prompt-len",
                                      "8", "--new-tokens", "4", "--repeat", "2", "--compare-torch", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for r in rows:
        low, high = r["torch_decode_tok_s_per_seq_range"]
        assert 0 < low <= r["torch_decode_tok_s_per_seq"] <= high and r["torch_ttft_ms"] > 0
        # (the ratios are reported to 2 decimals: 0.005 off at most, 2.9 % of a tiny model's 0.17 on a busy VM)
        assert r["speedup_vs_torch"] == pytest.approx(r["decode_tok_s_per_seq"] / r["torch_decode_tok_s_per_seq"],
                                                      rel=0.02, abs=0.005)
        assert r["ttft_speedup_vs_torch"] == pytest.approx(r["torch_ttft_ms"] / r["ttft_ms"], rel=0.02, abs=0.005)


def test_bench_alternates_the_engine_and_transformers(tiny_llama: Built, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine run of a configuration is followed by transformers on the same prompts, and the peer's child
    process is closed at the end."""
    from llmc.bench import torch_ref

    order: list[tuple[str, int, int]] = []
    real = engine_bench.measure

    def engine(loop: object, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        order.append(("engine", len(prompts), new_tokens))
        return real(loop, prompts, new_tokens)  # type: ignore[arg-type]

    speeds = iter([6.0, 20.0, 8.0, 30.0])  # batch 1, batch 2, batch 1, batch 2

    class FakePeer:
        closed = False

        def __init__(self, source: str, threads: int) -> None:
            assert source == str(tiny_llama.hf_dir) and threads >= 1

        def measure(self, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
            order.append(("torch", len(prompts), new_tokens))
            return {"torch_ttft_ms": 10.0, "torch_decode_tok_s_per_seq": next(speeds)}

        def __enter__(self) -> FakePeer:
            return self

        def __exit__(self, *exc: object) -> None:
            FakePeer.closed = True

    monkeypatch.setattr(engine_bench, "measure", engine)
    monkeypatch.setattr(torch_ref, "TorchPeer", FakePeer)
    rows = engine_bench.run_bench(engine_bench.BenchConfig(tiny_llama.engine_dir, (1, 2), 8, 4, repeat=2),
                                  compare_torch=True)
    timed = [x for x in order if x[2] == 4]  # (the engine's warm-up runs are 2 tokens)
    assert timed == [("engine", 1, 4), ("torch", 1, 4), ("engine", 2, 4), ("torch", 2, 4)] * 2
    assert FakePeer.closed
    assert [r["torch_decode_tok_s_per_seq_range"] for r in rows] == [[6.0, 8.0], [20.0, 30.0]]
    assert [r["torch_decode_tok_s_per_seq"] for r in rows] == [8.0, 30.0]  # the median run (upper of two)


def test_transformers_peer_names_a_source_it_cannot_load(tmp_path: Path) -> None:
    from llmc.bench.torch_ref import TorchPeer
    from llmc.errors import InputError

    with pytest.raises(InputError, match=r"--compare-torch could not load .*nothing"):
        TorchPeer(str(tmp_path / "nothing"), 1)
