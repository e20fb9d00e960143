"""Per-sequence states beside the KV cache (LFM2's convolution layers keep their last inputs, Qwen3.5's Gated
DeltaNet layers and Nemotron-H's Mamba-2 mixers those of their convolution and a recurrent state): each engine layout
carries a row's state from run to run exactly, leaves a row that did not run alone (a slot window's dummy rows),
moves it with its slot, starts a prompt from zeros, and the runtime never reuses a cached prefix for such a model
(the state of the prefix is not in its KV blocks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import Built

from llmc.engines.registry import load_engine_dir
from llmc.errors import InputError
from llmc.runtime.llm import LLM, LLMConfig
from llmc.runtime.request import SamplingParams

LAYOUTS = ("gqa", "concat", "onnx", "llmc", "onnx-static", "default")
TOL = {"default": 2e-3}  # (the default engine's fp16 KV cache); the fp32 caches' 1e-4


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()


def _hf_logits(hf: Any, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5_text", "nemotron_h", "kimi_linear", "mamba2", "falcon_h1",
                                        "mamba", "jamba", "zamba2"])
def stateful(request: pytest.FixtureRequest, tiny_factory: Callable[[str], Built]) -> Built:
    """A model with states: LFM2's convolutions, Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2 mixers, Kimi Linear's
    Kimi Delta Attention, Mamba-2 alone (no KV cache at all), Falcon-H1's mixers beside attention in every layer,
    Mamba-1 alone (its selective scan), Jamba's Mamba-1 mixers around attention, or Zamba2's Mamba-2 mixers with
    attention blocks before them."""
    return tiny_factory(request.param)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_row_that_waits_keeps_its_state(layout: str, stateful: Built, hf_factory: Callable[[Built], Any]) -> None:
    """Rows 0 and 2 decode while row 1 waits (a slot window runs it with a dummy token); then row 1 goes on as if
    alone, to transformers' logits."""
    engine = load_engine_dir(stateful.engine(layout))
    kv = engine.new_kv_cache(3, 64)
    prompts = [_ids(1, 5), _ids(2, 9), _ids(3, 4)]
    engine.prefill([0, 1, 2], prompts, kv)
    for t in range(3):
        engine.decode([0, 2], [[10 + t], [20 + t]], kv)
    seq = [*prompts[1], 7, 8, 9]
    got = [engine.decode([1], [[tok]], kv)[0] for tok in seq[len(prompts[1]):]]
    want = _hf_logits(hf_factory(stateful), seq)[len(prompts[1]):]
    assert max(float(np.abs(g - w).max()) for g, w in zip(got, want)) <= TOL.get(layout, 1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_moved_slot_takes_its_state_and_a_new_prompt_starts_from_zeros(layout: str, stateful: Built,
                                                                        hf_factory: Callable[[Built], Any]) -> None:
    engine = load_engine_dir(stateful.engine(layout))
    hf = hf_factory(stateful)
    kv = engine.new_kv_cache(2, 64)
    first, second = _ids(4, 11), _ids(5, 6)
    engine.prefill([0], [first], kv)
    engine.decode([0], [[9]], kv)  # slot 0's state: after this sequence's last inputs
    engine.prefill([1], [second], kv)
    kv.free(0)
    kv.move(1, 0)
    got = engine.decode([0], [[12]], kv)[0]
    assert float(np.abs(got - _hf_logits(hf, [*second, 12])[-1]).max()) <= TOL.get(layout, 1e-4)
    engine.prefill([1], [first], kv)  # (slot 1 held the moved sequence's state)
    got = engine.decode([1], [[9]], kv)[0]
    assert float(np.abs(got - _hf_logits(hf, [*first, 9])[-1]).max()) <= TOL.get(layout, 1e-4)


def test_the_state_changes_what_the_model_computes(stateful: Built) -> None:
    """The tests above would pass with a lost state only if it changed nothing: decoding after zeroed states
    gives other logits."""
    engine = load_engine_dir(stateful.engine("llmc"))
    kv = engine.new_kv_cache(1, 64)
    engine.prefill([0], [_ids(6, 8)], kv)
    state = [s.copy() for s in kv.states]
    kept = engine.decode([0], [[5]], kv)[0]
    kv.lengths[0] -= 1
    for s in kv.states:
        s[...] = 0
    lost = engine.decode([0], [[5]], kv)[0]
    assert any(np.abs(s).max() > 0 for s in state) and float(np.abs(kept - lost).max()) > 1e-2


def test_no_prefix_is_reused_for_a_model_with_states(stateful: Built) -> None:
    """The second prompt shares two KV blocks with the first; with states they are computed again, and its logits
    follow transformers' (a reused prefix would have left the row's state as another sequence's)."""
    llm = LLM(stateful.engine("default"))
    prefix = _ids(7, 140)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[*prefix, 5]], params)
    llm.generate([[*prefix, 6, 7]], params)
    stats = llm.loop.stats()
    assert stats.prefix_queried_tokens > 0 and stats.prefix_hit_tokens == 0


def test_pooled_states_in_a_slot_window_leave_its_dummy_rows_alone(tiny_factory: Callable[[str], Built],
                                                                    tmp_path: Any) -> None:
    """GroupQueryAttention over slot windows with llmc's 4-bit operator (and so its GatedDeltaRule): the states are
    pooled (in place, by state_rows) and a window's dummy rows run with no new tokens, so a row that waited decodes
    as it does alone."""
    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.manifest import load_engine

    tiny = tiny_factory("qwen3_5_text")
    build_ort(BuildConfig(tiny.export_dir, tmp_path / "e", attention="gqa", quant="int4", quality_target=0.0,
                          allow_divergence=True))
    assert any(s.pooled for s in load_engine(tmp_path / "e").kv.states)
    engine = load_engine_dir(tmp_path / "e")
    prompts = [_ids(1, 5), _ids(2, 9), _ids(3, 4)]
    kv = engine.new_kv_cache(3, 64)
    engine.prefill([0, 1, 2], prompts, kv)
    for t in range(3):
        engine.decode([0, 2], [[10 + t], [20 + t]], kv)
    waited = [engine.decode([1], [[tok]], kv)[0] for tok in (7, 8, 9)]
    kv = engine.new_kv_cache(3, 64)
    engine.prefill([1], [prompts[1]], kv)
    alone = [engine.decode([1], [[tok]], kv)[0] for tok in (7, 8, 9)]
    assert max(float(np.abs(a - b).max()) for a, b in zip(waited, alone)) <= 1e-4


def test_a_budget_the_rows_states_fill_is_refused_naming_it(tiny_factory: Callable[[str], Built]) -> None:
    """Every running row keeps its states (Qwen3.5's: ~6 KB a row here); a budget they would take half of is
    refused, naming what they take."""
    engine = tiny_factory("qwen3_5_text").engine("default")
    with pytest.raises(InputError, match=r"--kv-budget-mb 1: 100 sequences' states take .*lower --max-running"):
        LLM(engine, LLMConfig(kv_budget_mb=1, max_running=100))
    assert LLM(engine, LLMConfig(kv_budget_mb=1, max_running=8)).loop.max_len >= 16


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
def test_mamba1_mixers_build_quantized(arch: str, tiny_factory: Callable[[str], Built], tmp_path: Any) -> None:
    """A Mamba-1 mixer's products in llmc's 8- and 4-bit tiles (mamba_in: x and z, 2 x channels wide; mamba_x: dt,
    B and C; mamba_dt where its input, the dt rank, is a multiple of the kernels' block: Jamba's 32, not Mamba's 8,
    which stays fp32): both engines build (the build's golden check runs them), Jamba's 8-bit logits near its fp32
    export's (Mamba's tiny random model is chaotic: docs/architectures.md)."""
    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.manifest import load_engine

    tiny = tiny_factory(arch)
    ids = _ids(4, 20)
    exact = load_engine_dir(tiny.engine("llmc"))
    ref = exact.prefill([0], [ids], exact.new_kv_cache(1, 32))[0]
    for quant in ("int8", "int4"):
        build_ort(BuildConfig(tiny.export_dir, tmp_path / quant, quant=quant, quality_target=0.0,
                              allow_divergence=True))
        model = onnx.load(str(tmp_path / quant / load_engine(tmp_path / quant).decode.file), load_external_data=False)
        tiles = {i.name for i in model.graph.initializer if ".mamba_" in i.name and i.name.endswith("tiles")}
        products = ("in", "out", "x") if arch == "mamba" else ("in", "out", "x", "dt")
        assert tiles == {f"layers.{i}.mamba_{p}.weight.{'q4' if quant == 'int4' else 'q8'}tiles"
                         for i in ((0, 1, 2) if arch == "mamba" else (0, 2)) for p in products}
        engine = load_engine_dir(tmp_path / quant)
        got = engine.prefill([0], [ids], engine.new_kv_cache(1, 32))[0]
        assert np.isfinite(got).all()
        if arch == "jamba" and quant == "int8":
            assert float(np.abs(got - ref).max()) <= 0.05 * float(np.abs(ref).max())
