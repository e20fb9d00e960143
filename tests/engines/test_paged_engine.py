"""The in-place engine over paged KV memory (llmc's attention operator with block tables) against the same operator
over one slot per sequence: tokens of mixed-length batches, logits after a cached prefix, and a preempted sequence
resuming to the uninterrupted greedy output (tiny llama, fp32 caches)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import Built

from llmc.engines.base import EngineOptions, PagedKVCache
from llmc.engines.host_kv import HostPagedKVCache
from llmc.engines.registry import load_engine_dir
from llmc.engines.steps import StepRows
from llmc.graph import io_names
from llmc.runtime.block_manager import BlockManager
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.generator import EngineLoop
from llmc.runtime.request import SamplingParams

PROMPTS = [[5, 9, 11, 3, 7, 2, 8, 8, 4, 19, 21, 6, 5, 9, 30, 31, 12, 13, 40, 41, 7], [4, 8], [3, 5, 7, 9, 11, 13],
           list(range(3, 40))]


@pytest.fixture(scope="module")
def slot_engine(tiny_llama: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmc.engines.ort.build import BuildConfig, build_ort

    out = tmp_path_factory.mktemp("slots") / "e"
    manifest = build_ort(BuildConfig(tiny_llama.export_dir, out, attention="llmc", kv_dtype="float32",
                                     kv_paged=False))
    assert not manifest.kv.paged
    return out


BLOCKS_OF_16 = EngineOptions(kv_block_size=16)  # the tests below count in blocks of 16 tokens


def generate(engine_dir: Path, prompts: list[list[int]], config: RuntimeConfig, max_tokens: int = 12) -> list:
    loop = EngineLoop(load_engine_dir(engine_dir, config.engine_options()), None, config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [loop.add_request(p, params) for p in prompts]
    while loop.has_work:
        loop.step()
    return [loop.result(r).outputs[0].token_ids for r in rids]


@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_tokens_equal_slot_tokens_for_mixed_lengths(tiny_llama: Built, slot_engine: Path,
                                                          block_size: int) -> None:
    paged = load_engine_dir(tiny_llama.engine("llmc"))
    assert paged.manifest.kv.paged and paged.kv_block_size == EngineOptions().kv_block_size == 64
    assert paged.manifest.kv.key_tiles and not load_engine_dir(slot_engine).manifest.kv.key_tiles
    config = RuntimeConfig(max_running=4, kv_budget_mb=4, max_step_tokens=24, min_chunk=4, kv_block_size=block_size)
    want = generate(slot_engine, PROMPTS, config)
    assert generate(tiny_llama.engine("llmc"), PROMPTS, config) == want
    assert generate(tiny_llama.engine("llmc"), PROMPTS[::-1], config) == want[::-1]


def test_blocks_smaller_than_a_group_of_keys_are_refused_naming_the_size(tiny_llama: Built) -> None:
    """A paged engine holds its keys 16 positions at a time (key_tiles): a block size under 16 is refused at load,
    naming it, where it would otherwise fail inside the first step."""
    from llmc.errors import InputError

    with pytest.raises(InputError, match="--kv-block-size 8: this engine holds its keys in groups of 16 positions"):
        load_engine_dir(tiny_llama.engine("llmc"), EngineOptions(kv_block_size=8))


def test_prefix_cached_logits_equal_uncached(tiny_llama: Built) -> None:
    engine = load_engine_dir(tiny_llama.engine("llmc"), BLOCKS_OF_16)
    system, question = list(range(3, 35)), [40, 41, 42, 7]  # 32 tokens: two blocks of 16
    kv = engine.new_paged_kv_cache(2, 128, 16)
    assert isinstance(kv, HostPagedKVCache)
    kv.tables[0], kv.tables[1] = [0, 1, 2], [3, 4, 5]
    alone = engine.prefill([0], [system + question], kv)  # uncached: the whole prompt
    engine.prefill([1], [system + [9, 9]], kv)
    kv.tables[0], kv.lengths[0] = [3, 4, 6], 32  # the other sequence's two prefix blocks, then its own
    before = [buf[3:5].copy() for buf in kv.buffers()]
    cached = engine.decode([0], [question], kv)
    assert np.abs(cached - alone).max() <= 1e-5
    for buf, old in zip(kv.buffers(), before):  # the shared prefix blocks were read, never written
        np.testing.assert_array_equal(buf[3:5], old)


def test_prefix_caching_in_the_loop_computes_only_the_rest_with_the_same_tokens(tiny_llama: Built) -> None:
    system = list(range(3, 51))  # 48 tokens: three blocks
    prompts = [system + [60 + i, 61] for i in range(3)]
    on, off = (RuntimeConfig(max_running=4, kv_budget_mb=4, prefix_caching=p, kv_block_size=16) for p in (True, False))
    loop = EngineLoop(load_engine_dir(tiny_llama.engine("llmc"), on.engine_options()), None, on)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = loop.add_request(prompts[0], params)
    while loop.has_work:
        loop.step()
    rids = [loop.add_request(p, params) for p in prompts[1:]]
    while loop.has_work:
        loop.step()
    assert [s.cached_tokens for r in rids for s in loop.requests[r]] == [48, 48]
    got = [loop.result(r).outputs[0].token_ids for r in (first, *rids)]
    assert got == generate(tiny_llama.engine("llmc"), prompts, off, max_tokens=6)


def test_preempted_sequence_resumes_to_the_same_greedy_output(tiny_llama: Built) -> None:
    config = RuntimeConfig(max_running=3, kv_budget_mb=4, kv_block_size=16)
    loop = EngineLoop(load_engine_dir(tiny_llama.engine("llmc"), config.engine_options()), None, config)
    assert isinstance(loop.kv, PagedKVCache)
    loop.scheduler.blocks = BlockManager(9, loop.kv.block_size)  # 144 tokens for three sequences of 60
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3 + i, 23 + i)) for i in range(3)]
    rids = [loop.add_request(p, params) for p in prompts]
    while loop.has_work:
        loop.step()
    assert loop.stats().preemptions > 0
    got = [loop.result(r).outputs[0].token_ids for r in rids]
    assert got == generate(tiny_llama.engine("llmc"), prompts, config, 40)


def test_chunks_of_different_lengths_run_together_and_equal_one_row_runs(tiny_llama: Built,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows after a past with 4, 4, 2 and 1 new tokens: one run (new_tokens), the same logits as one run per row
    (the row of one token alone: a one-token step)."""
    engine = load_engine_dir(tiny_llama.engine("llmc"))
    assert io_names.NEW_TOKENS in engine.manifest.decode.input_names()
    runs: list[list[int]] = []
    real_run, real_step = engine._run, engine._paged_step

    def counting(graph: str, kv: object, rows: StepRows) -> np.ndarray:
        runs.append(rows.counts.tolist())
        return real_run(graph, kv, rows)

    def counting_step(kv: HostPagedKVCache, slots: list[int], tokens: list[int]) -> np.ndarray:
        runs.append([1] * len(slots))
        return real_step(kv, slots, tokens)

    monkeypatch.setattr(engine, "_run", counting)
    monkeypatch.setattr(engine, "_paged_step", counting_step)
    prompts = [[5, 9, 11], list(range(3, 40)), [4, 8, 30, 31, 2], [6, 7]]
    chunks = [[7, 8, 9, 10], [11, 12, 13, 14], [3, 3], [9]]
    logits = []
    for together in (True, False):
        kv = engine.new_kv_cache(4, 64)
        engine.prefill([0, 1, 2, 3], prompts, kv)
        runs.clear()
        calls = [([0, 1, 2, 3], chunks)] if together else [([s], [chunks[s]]) for s in range(4)]
        logits.append(np.concatenate([engine.decode(slots, toks, kv) for slots, toks in calls]))
        assert runs == ([[4, 4, 2, 1]] if together else [[4], [4], [2], [1]])
        assert kv.lengths.tolist() == [7, 41, 7, 3]
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-5, rtol=0)
    assert engine._logits.shape[0] == 4  # runs of 4 and of 1 row shared one logits buffer, as large as the largest


def test_one_token_steps_on_their_bound_table_equal_one_row_steps(tiny_llama: Built) -> None:
    """A decode step of one token a row runs on a binding made once per batch size (its block table bound as wide as
    a table can be, rewritten in place): rows whose order swaps between steps, so that a row of the bound table
    holds a short table after a long one, get the logits of the same rows decoded one at a time."""
    engine = load_engine_dir(tiny_llama.engine("llmc"))
    prompts = [list(range(3, 40)), [4, 8, 30]]  # 37 tokens: three blocks; 3: one
    kvs = []
    for _ in range(2):
        kv = engine.new_paged_kv_cache(2, 64, 8)
        assert isinstance(kv, HostPagedKVCache)
        kv.tables[0], kv.tables[1] = [5, 1, 6, 2], [3, 7]
        engine.prefill([0, 1], prompts, kv)
        kvs.append(kv)
    earlier = []
    for step, slots in enumerate(([0, 1], [1, 0], [0, 1], [1])):
        tokens = [[10 + step + s] for s in slots]
        together = engine.decode(slots, tokens, kvs[0])
        alone = np.concatenate([engine.decode([s], [t], kvs[1]) for s, t in zip(slots, tokens)])
        np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)
        earlier.append((together, together.copy()))
    for kept, value in earlier:  # each step's logits are the caller's: later steps reuse the bound buffer, not them
        np.testing.assert_array_equal(kept, value)
    assert kvs[0].lengths.tolist() == kvs[1].lengths.tolist() == [40, 7]
    assert {key[2] for key in engine._steps} == {1, 2}  # one binding per batch size, whatever the rows


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # (GPT-2's learned positions: its graph takes position_ids)
def test_a_one_token_step_binds_the_inputs_the_step_core_feeds(tiny_factory: Callable[[str], Built], arch: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual decode step (paged memory, one token a row) fills its bound arrays a row at a time instead of
    building the step core's rows and feeds: what it binds is what `_feeds` gives for the same rows (positions,
    seqlens_k, total_seq_len, each row's blocks), with rows out of slot order and tables of different lengths, and
    it runs once, through no `_run`."""
    engine = load_engine_dir(tiny_factory(arch).engine("llmc"), BLOCKS_OF_16)
    assert (io_names.POSITION_IDS in engine._input_names) == (arch == "gpt2")
    kv = engine.new_paged_kv_cache(3, 64, 12)
    assert isinstance(kv, HostPagedKVCache)
    kv.tables[0], kv.tables[1], kv.tables[2] = [5, 1, 6], [3], [0, 2, 4, 7]
    engine.prefill([0, 1, 2], [list(range(3, 40)), [4, 8, 30], list(range(5, 55))], kv)
    monkeypatch.setattr(engine, "_run", lambda *a: pytest.fail("a one-token step went through the step core"))
    for step, slots in enumerate(([2, 0, 1], [1, 2, 0])):
        start = kv.lengths[slots].copy()
        tokens = [[10 + step + s] for s in slots]
        logits = engine.decode(slots, tokens, kv)
        assert logits.shape == (3, engine.logits_size) and np.isfinite(logits).all()
        assert kv.lengths[slots].tolist() == (start + 1).tolist()
        rows = StepRows(slots, np.array(tokens, np.int64), start, np.ones(3, np.int64), 1)
        bound = engine._steps[(id(kv), 0, 3)][1]
        fed = engine._feeds(kv, rows)
        assert set(fed) - {io_names.NEW_TOKENS} <= set(bound)
        for name, want in fed.items():
            got = bound[name]
            if name == io_names.BLOCK_TABLE:  # (bound as wide as a table can be: each row's own blocks first)
                for b, slot in enumerate(slots):
                    assert got[b, :len(kv.tables[slot])].tolist() == kv.tables[slot]
            elif name == io_names.NEW_TOKENS:
                assert got.tolist() == [1, 1, 1]  # bound as ones
            else:
                np.testing.assert_array_equal(got.reshape(np.shape(want)), want, err_msg=name)


def test_a_new_paged_cache_never_runs_on_an_old_one_s_bindings(tiny_llama: Built,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine keys its bindings by the cache's id, which Python reuses once a cache is gone: with every id the
    same (as a freed cache's often is for the next), a new cache's one-token steps still read and write its own
    pools, not those bound for the one before."""
    import llmc.engines.ort.inplace as inplace

    engine = load_engine_dir(tiny_llama.engine("llmc"))

    def decoded(prompt: list[int]) -> list[np.ndarray]:
        kv = engine.new_paged_kv_cache(1, 64, 8)
        assert isinstance(kv, HostPagedKVCache)
        kv.tables[0] = [4, 6, 1, 3]
        out = [engine.prefill([0], [prompt], kv)]
        for token in (7, 9, 11):
            out.append(engine.decode([0], [[token]], kv))
        return out

    want = decoded(list(range(3, 40)))
    monkeypatch.setattr(inplace, "id", lambda obj: 1, raising=False)  # every cache's id the same
    decoded(list(range(50, 80)))  # another prompt in another cache
    for got, expected in zip(decoded(list(range(3, 40))), want):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_a_bound_block_table_takes_the_blocks_a_row_can_read() -> None:
    """The one-token step's table is ceil(max_len / block_size) wide: each row's blocks are written over what an
    earlier row left, and a block reserved past max_len (never read) is left out."""
    from llmc.manifest import KVSpec

    spec = KVSpec(layout="inplace", dtype="float16", num_layers=1, num_kv_heads=1, head_dim=4,
                  past_key="pk{i}", past_value="pv{i}", present_key="k{i}", present_value="v{i}", paged=True)
    kv = HostPagedKVCache(spec, 2, 32, 8, 16)
    out = np.full((2, 2), 7, np.int32)
    kv.tables[0], kv.tables[1] = [3, 5, 6], [2]
    assert kv.block_table([0, 1], out) is out
    assert out.tolist() == [[3, 5], [2, 7]]
    assert kv.block_table([1, 0]).tolist() == [[2, 0, 0], [3, 5, 6]]
