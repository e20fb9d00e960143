"""Exported graphs and the ORT engine against transformers, for a tiny random model of every architecture."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import ARCHS, LAYOUTS, Built

from llmc import LLM, SamplingParams
from llmc.engines.base import Engine
from llmc.engines.registry import load_engine_dir
from llmc.errors import LimitError
from llmc.export.arch import MLA as ARCH_MLA
from llmc.export.arch import MLA_DENSE, SPARSE_INDEXED
from llmc.manifest import load_export
from llmc.onnx_store import ALIGN
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.generator import EngineLoop
from llmc.runtime.llm import LLMConfig

TOL = 1e-4
GREEDY_TOKENS = 16


def _ids(seed: int, n: int, vocab: int = 320) -> list[int]:
    """Random prompt ids that avoid the special tokens (0..2)."""
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


PROMPTS = [_ids(1, 1), _ids(2, 5), _ids(3, 23), _ids(4, 100)]  # 100: past llama3's original 64 positions


def _hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    """transformers' logits at every position of one sequence: [S, V]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _hf_greedy(model: Any, ids: list[int], n: int = GREEDY_TOKENS) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(ids):].tolist()
    assert len(tokens) == n
    return tokens


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max())


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture()
def engine(tiny: Built, layout: str) -> Engine:
    return load_engine_dir(tiny.engine(layout))


@pytest.fixture()
def hf(tiny: Built, hf_factory: Callable[[Built], Any]) -> Any:
    return hf_factory(tiny)


# -- engine vs transformers ---------------------------------------------------------------------------------

def test_prefill_logits_match_transformers(engine: Engine, hf: Any) -> None:
    for ids in PROMPTS:
        kv = engine.new_kv_cache(1, 128)
        ours = engine.prefill([0], [ids], kv)[0]
        ref = _hf_logits(hf, ids)[-1]
        assert _max_diff(ours, ref) <= TOL, f"prompt of {len(ids)} tokens"


def test_greedy_continuation_matches_transformers(tiny: Built, hf: Any, layout: str) -> None:
    llm = LLM(tiny.engine(layout))
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    text_prompt = llm.encode("The capital of France is")
    for ids in (text_prompt, PROMPTS[2]):
        out = llm.generate([ids], params)[0]
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == _hf_greedy(hf, ids)
        assert out.outputs[0].finish_reason.value == "length"


def test_prefill_then_decode_equals_full_prefill(engine: Engine, hf: Any) -> None:
    seq = _ids(5, 30)
    n = 9
    full = _hf_logits(hf, seq)
    kv = engine.new_kv_cache(1, 64)
    steps = [engine.prefill([0], [seq[:n]], kv)[0]]
    steps += [engine.decode([0], [[t]], kv)[0] for t in seq[n:]]
    assert int(kv.lengths[0]) == len(seq)
    for j, logits in enumerate(steps):
        pos = n - 1 + j
        fresh = engine.new_kv_cache(1, 64)
        assert _max_diff(logits, engine.prefill([0], [seq[:pos + 1]], fresh)[0]) <= TOL, f"step {j}"
        assert _max_diff(logits, full[pos]) <= TOL, f"step {j} vs transformers"


def _hf_incremental(model: Any, prompt: list[int], steps: list[int]) -> list[np.ndarray]:
    """transformers' next-token logits after the prompt and after each teacher-forced step, decoding with its own
    cache as `generate` does (for longrope the table is chosen per call, as it is there), the positions given as
    `generate` gives them (Bamba's forward would number each call's tokens from 0)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out, logits, done = None, [], 0
    with torch.no_grad():
        for ids in [prompt, *[[t] for t in steps]]:
            positions = torch.arange(done, done + len(ids))[None]
            done += len(ids)
            new_name = model.config.model_type in ("mamba2", "mamba", "falcon_mamba", "jamba", "zamba2")  # (their
            # forward takes the cache by its new name only, or warns at the old one; Mamba-1 alone returns it as
            # `cache`)
            cached = {"cache": cache} if new_name else {"past_key_values": cache}
            out = model(torch.tensor([ids]), use_cache=True, position_ids=positions, **cached)
            cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
            logits.append(out.logits[0, -1].float().numpy())
    return logits


def test_teacher_forced_decode_matches_transformers(engine: Engine, hf: Any) -> None:
    """16 one-token steps after a 56-token prompt (they cross phi3's longrope threshold of 64 and every sliding
    window), each step's logits against transformers decoding the same tokens with its cache."""
    seq = _ids(14, 56 + 16)
    ref = _hf_incremental(hf, seq[:56], seq[56:])
    kv = engine.new_kv_cache(1, 96)
    ours = [engine.prefill([0], [seq[:56]], kv)[0]] + [engine.decode([0], [[t]], kv)[0] for t in seq[56:]]
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert _max_diff(a, b) <= TOL, f"step {step}"


def test_decode_chunk_equals_full_prefill(engine: Engine, hf: Any) -> None:
    """The decode graph with S > 1 new tokens (a prompt chunk) continues a prefill correctly, and one-token decode
    steps before and after it on the same row stay correct (they reuse bindings the chunk must not disturb)."""
    seq = _ids(6, 42)
    kv = engine.new_kv_cache(1, 64)
    engine.prefill([0], [seq[:11]], kv)
    engine.decode([0], [seq[11:12]], kv)
    chunked = engine.decode([0], [seq[12:40]], kv)[0]
    whole = engine.prefill([0], [seq[:40]], engine.new_kv_cache(1, 64))[0]
    assert _max_diff(chunked, whole) <= TOL
    hf_logits = _hf_logits(hf, seq)
    assert _max_diff(chunked, hf_logits[39]) <= TOL
    for pos in (40, 41):
        assert _max_diff(engine.decode([0], [seq[pos:pos + 1]], kv)[0], hf_logits[pos]) <= TOL, pos


def test_decode_into_a_full_slot_is_refused_and_changes_nothing(engine: Engine) -> None:
    kv = engine.new_kv_cache(2, 16)
    engine.prefill([0, 1], [_ids(1, 16), _ids(2, 5)], kv)
    for tokens in ([[7], [7]], [[7, 8], [9]]):  # one-token step, and a step with a prompt chunk
        with pytest.raises(LimitError, match="16"):
            engine.decode([0, 1], tokens, kv)
        assert kv.lengths[:2].tolist() == [16, 5]
    assert engine.decode([1], [[7]], kv).shape == (1, engine.logits_size) and int(kv.lengths[1]) == 6


@pytest.mark.parametrize(("arch", "layout"), [(a, lay) for a in ARCHS for lay in LAYOUTS])
def test_batch_equals_singles(arch: str, layout: str, tiny_factory: Callable[[str], Built],
                              hf_factory: Callable[[Built], Any]) -> None:
    tiny = tiny_factory(arch)
    hf = hf_factory(tiny)
    llm = LLM(tiny.engine(layout))
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    prompts = [_ids(7, 3), _ids(8, 17), _ids(9, 8)]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    singles = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == singles
    assert batched[1] == _hf_greedy(hf, prompts[1])


@pytest.mark.parametrize(("arch", "layout"), [(a, lay) for a in ARCHS for lay in LAYOUTS])
def test_more_prompts_than_slots(arch: str, layout: str, tiny_factory: Callable[[str], Built]) -> None:
    """Six prompts through two KV slots: slots are freed, reused and compacted without mixing sequences."""
    engine_dir = tiny_factory(arch).engine(layout)
    # Different lengths, so a slot frees while another sequence is still decoding (its KV is moved).
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 15, 9, 12, 3, 14)]
    prompts = [_ids(20 + i, n) for i, n in enumerate([3, 40, 9, 100, 1, 17])]
    llm = LLM(engine_dir)
    singles = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    two_slots = LLM(engine_dir, LLMConfig(max_running=2)).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in two_slots] == singles


def test_chunked_prompts_equal_singles(engine: Engine) -> None:
    """A small per-step token budget splits long prompts into chunks run by the decode graph (S > 1)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [_ids(30, 100), _ids(31, 5), _ids(32, 47)]
    chunk_sizes: list[int] = []
    decode = engine.decode

    def spy(slots: list[int], tokens: list[list[int]], kv: Any, **kwargs: Any) -> np.ndarray:
        chunk_sizes.extend(len(t) for t in tokens if len(t) > 1)
        return decode(slots, tokens, kv, **kwargs)

    engine.decode = spy  # type: ignore[method-assign]
    singles = []
    for p in prompts:
        loop = EngineLoop(engine, None, RuntimeConfig(max_running=3))
        rid = loop.add_request(p, params)
        while loop.has_work:
            loop.step()
        singles.append(loop.pop(rid).outputs[0].token_ids)
    assert not chunk_sizes, "a 2048-token budget needs no chunks"
    loop = EngineLoop(engine, None, RuntimeConfig(max_running=3, max_step_tokens=16))
    rids = [loop.add_request(p, params) for p in prompts]
    while loop.has_work:
        loop.step()
    assert [loop.pop(r).outputs[0].token_ids for r in rids] == singles
    assert chunk_sizes, "the long prompts were not chunked"


# -- the raw graphs through onnxruntime -----------------------------------------------------------------------

def _sessions(export_dir: Path) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return tuple(ort.InferenceSession(str(export_dir / f), so, providers=["CPUExecutionProvider"])  # type: ignore[return-value]
                 for f in ("prefill.onnx", "decode.onnx"))


def _past(kv_spec: Any, batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    states = {n: rng.standard_normal((batch, *s.shape)).astype(np.float32) for s in kv_spec.states
              for n in s.names("past")}  # (LFM2's convolutions' last inputs)
    return {**{n: rng.standard_normal(kv_spec.buffer_shape(j // 2, batch, length)).astype(np.float32)
               for j, n in enumerate(kv_spec.names("past"))}, **states}


def test_graph_axes_are_symbolic(tiny: Built) -> None:
    manifest = load_export(tiny.export_dir)
    for session, spec in zip(_sessions(tiny.export_dir), (manifest.prefill, manifest.decode)):
        declared = {i.name: i.shape for i in session.get_inputs()} | {o.name: o.shape for o in session.get_outputs()}
        for t in (*spec.inputs, *spec.outputs):
            assert list(t.shape) == declared[t.name], t.name
            assert isinstance(declared[t.name][0], str), f"{t.name}: batch axis fixed at export"
        assert isinstance(declared["input_ids"][1], str)


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_graphs_run_at_many_shapes(tiny: Built, batch: int) -> None:
    manifest = load_export(tiny.export_dir)
    prefill, decode = _sessions(tiny.export_dir)
    kv, vocab, width = manifest.kv, manifest.model.vocab_size, manifest.model.logits_size
    rng = np.random.default_rng(batch)
    for s in (1, 7, 33):
        ids = rng.integers(3, vocab, size=(batch, s)).astype(np.int64)  # (any input id, past a pruned head's too)
        pos = np.tile(np.arange(s, dtype=np.int64), (batch, 1))
        logits, *present = prefill.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                              "position_ids": pos})
        assert logits.shape == (batch, 1, width) and logits.dtype == np.float32
        present, states = present[:2 * kv.num_layers], present[2 * kv.num_layers:]
        assert [p.shape for p in present] == [kv.buffer_shape(j // 2, batch, s) for j in range(len(present))]
        assert [t.shape for t in states] == [(batch, *st.shape) for st in kv.states for _ in range(st.count)]
        for past in (1, 9, 40):
            feeds = {"input_ids": ids, "attention_mask": np.ones((batch, past + s), np.int64),
                     "position_ids": pos + past, **_past(kv, batch, past, seed=past)}
            logits, *present = decode.run(None, feeds)
            assert logits.shape == (batch, s, width)
            assert [p.shape for p in present[:2 * kv.num_layers]] == [kv.buffer_shape(j // 2, batch, past + s)
                                                                    for j in range(2 * kv.num_layers)]
            assert np.isfinite(logits).all()


def test_right_padded_batch_rows_equal_single_rows(tiny: Built) -> None:
    """Graph level: a right-padded row gives the logits and cache (and states: its own last inputs) it gives alone."""
    prefill, decode = _sessions(tiny.export_dir)
    kv_tensors = 2 * load_export(tiny.export_dir).kv.num_layers
    rows = [_ids(10, 7), _ids(11, 3), _ids(12, 5)]
    width = max(map(len, rows))
    ids = np.zeros((3, width), np.int64)
    mask = np.zeros((3, width), np.int64)
    for b, r in enumerate(rows):
        ids[b, :len(r)], mask[b, :len(r)] = r, 1
    pos = np.tile(np.arange(width, dtype=np.int64), (3, 1))
    logits, *present = prefill.run(None, {"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    for b, r in enumerate(rows):
        one = np.array([r], np.int64)
        ref_logits, *ref_present = prefill.run(None, {"input_ids": one, "attention_mask": np.ones_like(one),
                                                      "position_ids": np.arange(len(r))[None]})
        assert _max_diff(logits[b], ref_logits[0]) <= TOL
        for p, q in zip(present[:kv_tensors], ref_present):
            assert _max_diff(p[b, :, :len(r)], q[0]) <= TOL
        for p, q in zip(present[kv_tensors:], ref_present[kv_tensors:]):
            assert _max_diff(p[b], q[0]) <= TOL


def test_decode_graph_chunk_logits_match_transformers(tiny: Built, hf: Any) -> None:
    """decode.onnx returns logits for every new token [B, S, V]; each matches transformers' full forward."""
    manifest = load_export(tiny.export_dir)
    prefill, decode = _sessions(tiny.export_dir)
    seq, n = _ids(13, 20), 8
    head = np.array([seq[:n]], np.int64)
    _, *present = prefill.run(None, {"input_ids": head, "attention_mask": np.ones_like(head),
                                     "position_ids": np.arange(n)[None]})
    tail = np.array([seq[n:]], np.int64)
    feeds = {"input_ids": tail, "attention_mask": np.ones((1, len(seq)), np.int64),
             "position_ids": np.arange(n, len(seq))[None],
             **dict(zip(manifest.kv.names("past") + manifest.kv.state_names("past"), present))}
    logits, *_ = decode.run(None, feeds)
    assert _max_diff(logits[0], _hf_logits(hf, seq)[n:]) <= TOL


# -- the manifest and the files -------------------------------------------------------------------------------

def test_manifest_records_architecture(tiny: Built, hf: Any) -> None:
    m, cfg = load_export(tiny.export_dir).model, hf.config
    layers = getattr(cfg, "num_hidden_layers", getattr(cfg, "n_layer", None))
    # (Mamba alone: its mixers' heads stand in for attention's; Mamba-1's channels as heads of 64, or 48)
    heads = {"mamba2": 8, "mamba": 2, "falcon_mamba": 2}.get(tiny.name, 4)
    assert m.num_layers == layers and m.num_heads == heads and m.vocab_size == 320
    assert m.hidden_size == {"phi3": 128, "falcon_mamba": 48}.get(tiny.name, 64)
    mla = tiny.name in (*ARCH_MLA, "kimi_linear")  # one KV head: the latent (+ the rotated key)
    assert m.num_kv_heads == (1 if mla else {"gpt2": 4, "opt": 4, "gpt_neox": 4, "gemma": 1, "gpt_bigcode": 1,
                                             "mimo_v2_flash": 2,  # (its sliding layers': twice its full ones')
                                             "falcon_mqa": 1, "falcon_seq": 4, "gptj": 4, "mamba2": 8, "mamba": 2,
                                             "falcon_mamba": 2, "zamba2": 4}.get(tiny.name,
                                                                                                         2))
    assert (m.mla_kv_rank, m.mla_nope_dim, m.mla_v_dim, m.head_dim, m.rotary_dim) == (
        (32, 24, 16, 40, 8) if mla else (0, 0, 0, m.head_dim, m.rotary_dim))
    assert m.mla_q_rank == (32 if tiny.name in ("deepseek_v3", "glm4_moe_lite", "minicpm3", "youtu", "axk1",
                                                *SPARSE_INDEXED)
                            else 0)
    # (DeepSeek Sparse Attention: every key up to index_topk, 128 here; Kolibri 1.1: its pool, 192; else the model's)
    assert m.max_positions == (128 if tiny.name in SPARSE_INDEXED else 192 if tiny.name == "kolibri1_1" else
                               getattr(cfg, "max_position_embeddings", m.max_positions))
    mla_moe = mla and tiny.name not in MLA_DENSE
    if mla:  # the softmax's scale is the model's (V3: YaRN's mscale squared on (nope + rope) ** -0.5)
        first = 1 if tiny.name == "kimi_linear" else 0  # (its first attention layer)
        assert m.attention_scale == pytest.approx(hf.model.layers[first].self_attn.scaling)
    assert m.qkv_bias is (tiny.name in ("qwen2", "qwen2_moe", "gpt2", "starcoder2", "stablelm", "phi",
                                      "gpt_neox", "gpt_bigcode", "opt", "glm", "glm4", "helium",
                                      "seed_oss", "gpt_oss", "glm4_moe", "falcon", "falcon_seq", "jais2",
                                      "phimoe", "lfm3", "falcon_h1"))
    assert m.parallel_block == {"stablelm": "shared", "phi": "shared", "cohere": "shared", "cohere2": "shared",
                                "cohere2_moe": "shared",
                                "gpt_neox": "two", "falcon": "two", "falcon_mqa": "shared",
                                "gptj": "shared"}.get(tiny.name, "")
    assert m.rope_type == {"llama3": "llama3", "phi3": "longrope", "gemma3_text": "linear",
                           "gpt_oss": "yarn", "olmo3": "yarn", "hunyuan_v1_dense": "ntk_alpha",
                           "deepseek_v3": "yarn", "ministral3": "yarn", "apertus": "llama3", "apertus1p5_text": "llama3",
                           "cwm": "llama3",
                           "phimoe": "longrope", "lfm3": "proportional", "gemma4_text": "proportional",
                           "gemma4_e": "proportional", "gemma4_moe": "proportional"}.get(
        tiny.name, "default")
    assert m.tie_embeddings is bool(cfg.tie_word_embeddings)
    assert m.positions == ("learned" if tiny.name in ("gpt2", "gpt_bigcode", "opt") else "rope")
    windowed = {"mistral": 16, "qwen3": 8, "gemma2": 8, "gemma3_text": 8, "starcoder2": 16, "ministral": 8,
                "exaone4": 8, "gpt_oss": 8, "olmo3": 8, "dots1": 8, "cohere2": 8, "ministral3": 16, "afmoe": 8,
                "cwm": 8, "vaultgemma": 8, "exaone_moe": 8, "granite_swa": 8, "granitemoe_swa": 8, "mellum": 8,
                "flint": 8, "kolibri1": 8, "cohere2_moe": 8, "mimo_v2_flash": 8, "laguna": 8, "lfm3": 8,
                "lara_mini": 8, "gemma4_text": 8, "gemma4_e": 8, "gemma4_moe": 8, "kolibri1_1": 8}
    assert m.sliding_window == windowed.get(tiny.name, 0)
    if tiny.name in windowed:
        types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * m.num_layers
        types = [{"indexed_attention": "full_attention"}.get(t, t) for t in types]  # (Kolibri 1.1's: index_layers)
        assert list(m.layer_types) == types and any(m.window(i) for i in range(m.num_layers))
    assert m.qk_norm == {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "exaone4": "head",
                         "olmo2": "full", "olmo3": "full", "olmo_hybrid": "full", "glm4_moe": "head", "dots1": "head",
                         "olmoe": "full", "hunyuan_v1_dense": "head", "hunyuan_v1_moe": "head",
                         "minimax_m2": "full", "apertus": "head", "apertus1p5_text": "head", "afmoe": "head", "nanochat": "head",
                         "flex_olmo": "full", "exaone_moe": "head", "mellum": "head", "flint": "head",
                         "hy_v3": "head", "kolibri1": "head", "kolibri1_1": "head", "llama4_text": "head", "laguna": "head",
                         "lfm2": "head", "lfm2_moe": "head", "lfm3": "head",
                         "qwen3_5_text": "head", "qwen3_5_moe_text": "head", "qwen3_next": "head",
                         "lara_mini": "head", "gemma4_text": "head", "gemma4_e": "head",
                         "gemma4_moe": "head"}.get(tiny.name,
                                                                                                           "")
    assert m.qk_norm_after_rope is tiny.name.startswith("hunyuan")
    assert (m.query_scale_beta, m.query_scale_after) == {"ministral3": (0.4, 16), "llama4_text": (0.5, 512)}.get(
        tiny.name, (0.0, 0))
    assert (m.activation == "xielu") is (tiny.name in ("apertus", "apertus1p5_text"))
    # (Apertus 1.5's head without its multimodal rows: the logits that narrow, the inputs the whole vocabulary)
    assert (m.output_vocab_size, m.logits_size) == ((cfg.vocab_size - 40, cfg.vocab_size - 40)
                                                    if tiny.name == "apertus1p5_text" else (0, cfg.vocab_size))
    assert m.attn_output_gate is (tiny.name in ("afmoe", "minicpm5_moe", "laguna", "lfm3", "qwen3_5_text",
                                                "qwen3_5_moe_text", "qwen3_next"))
    assert m.attn_gate_activation == ("softplus" if tiny.name == "laguna" else "sigmoid")
    if tiny.name in ("granite_swa", "flint", "kolibri1", "kolibri1_1"):  # (a layer without rotary: Granite SWA's
        # theta 0, the full layers of Flint and Kolibri-1, Kolibri 1.1's indexed ones)
        assert m.rope_layers == {"granite_swa": (False, True),
                                 "kolibri1_1": (True, False, True, False, True)}.get(tiny.name, (True, False))
    # (Kolibri 1.1: indexed layers past 2 + 6 + 4 keys, the second reading the first's cache; a dense first layer)
    assert (m.index_layers, m.index_budget, m.kv_sources) == (((False, True, False, True, False), 12, (0, 1, 2, 1, 4))
                                                              if tiny.name == "kolibri1_1" else ((), 0, m.kv_sources))
    if tiny.name == "cohere2_moe":  # (RMSNorm: rms_norm_eps set; RoPE on the dense and the sliding layer)
        assert (m.norm, m.rope_layers, m.intermediate_size) == ("rms", (True, True, False), 64)
    if tiny.name == "llama4_text":  # (its weightless qk-norm on its rotated layers only; a chunk as long as the
        # model's positions is none; the query temperature on its layer without rotary)
        assert (m.qk_norm, m.qk_norm_layers, m.rope_layers, m.attention_chunk) == ("head", (True, True, False),
                                                                                   (True, True, False), 0)
        assert (m.query_scale_beta, m.query_scale_after, m.query_scale_offset, m.query_scale_nope_only) == (
            0.5, 512, 1, True)
        assert m.moe_scale_inputs and m.intermediate_size == 96 and m.moe_intermediate_size == 32
    else:
        assert not m.moe_scale_inputs and not m.qk_norm_layers
    assert m.moe_post_norm is (tiny.name == "axk1")
    if tiny.name == "phimoe":  # (longrope's short table only, times its mscale; sparsemixer's threshold)
        assert (m.norm, m.rope_attention_scaling, m.rope_long_after, m.moe_jitter_eps) == ("layer", 1.25, 0, 0.3)
    if tiny.name == "dbrx":  # (its fused q/k/v clamped, LayerNorm without bias)
        assert (m.norm, m.norm_eps, m.clip_qkv) == ("layer", 1e-5, 1.0)
    if tiny.name == "mimo_v2_flash":  # (partial rotary of the same width on both layer types' tables)
        assert (m.head_dim, m.rotary_dim) == (16, 8)
    if tiny.name == "jais2":
        assert (m.norm, m.plain_mlp, m.activation) == ("layer", True, "relu2")
    if tiny.name in ("lfm2", "lfm2_moe"):  # (conv layers: no KV, a state of the last 2 inputs; LFM2's MLP sized
        # as it sizes itself, LFM2-MoE's dense one intermediate_size wide)
        assert (m.layer_types, m.conv_kernel, m.kv_layers, m.intermediate_size) == (
            ("conv", "full_attention", "conv"), 3, (1,), 64 if tiny.name == "lfm2" else 96)
        kv = load_export(tiny.export_dir).kv
        assert (kv.num_layers, kv.state_names("past"), kv.states[0].shape) == (1, ["past_conv.0", "past_conv.1"],
                                                                               (2, 64))
    elif tiny.name == "lara_mini":  # (RoPE on its sliding layer only, a router in fp32)
        assert (m.kv_layers, m.rope_layers, m.moe_router_fp32, m.linear_v_heads) == ((1, 2), (False, True, False),
                                                                                    True, 4)
    elif tiny.name in ("qwen3_5_text", "qwen3_next"):  # (Gated DeltaNet layers: their conv and recurrent states,
        # no KV)
        assert (m.kv_layers, m.linear_k_heads, m.linear_v_heads, m.linear_k_dim, m.linear_v_dim,
                m.linear_conv_kernel, m.rotary_dim) == ((1,), 2, 4, 16, 8, 4, 8)
        kv = load_export(tiny.export_dir).kv
        assert [(s.past, s.count, s.shape) for s in kv.states] == [("past_linear_conv.{i}", 2, (3, 96)),
                                                                   ("past_recurrent.{i}", 2, (4, 16, 8))]
    elif tiny.name == "olmo_hybrid":  # (Gated DeltaNet layers normed before, the attention layer after; beta
        # doubled, the output norm's own epsilon)
        assert (m.kv_layers, m.norm_layouts, m.linear_beta_scale, m.linear_norm_eps, m.qk_norm) == (
            (1,), ("pre", "post", "pre"), 2.0, 1e-5, "full")
    elif tiny.name == "kimi_linear":  # (Kimi Delta Attention: the same states, a decay per key dim; latent
        # attention without positions)
        assert (m.kv_layers, m.linear_kind, m.linear_k_heads, m.linear_v_heads, m.linear_k_dim, m.linear_conv_kernel,
                m.rope_layers) == ((1,), "kda", 4, 4, 32, 4, (False, False, False))
        kv = load_export(tiny.export_dir).kv
        assert [(s.past, s.count, s.shape) for s in kv.states] == [("past_linear_conv.{i}", 2, (3, 384)),
                                                                   ("past_recurrent.{i}", 2, (4, 32, 32))]
    elif tiny.name == "qwen3_5_moe_text":
        assert (m.kv_layers, m.linear_k_heads, m.linear_v_heads, m.linear_k_dim, m.linear_v_dim,
                m.linear_conv_kernel, m.rotary_dim) == ((1,), 2, 2, 16, 16, 3, 4)
    elif tiny.name == "lfm3":  # (4 taps; sliding / full attention layers, their rotary tables per type)
        assert (m.conv_kernel, m.kv_layers, m.rope_type, m.head_dim, m.rotary_dim) == (4, (1, 3), "proportional", 16, 0)
    else:
        assert m.conv_kernel == 0 and "conv" not in m.layer_types
    mamba = {"granitemoehybrid": (("mamba", "full_attention", "mamba"), (1,), (8, 16, 16, 2, 4), ()),
             "granitemoehybrid_dense": (("mamba", "full_attention"), (1,), (4, 32, 32, 1, 4), ()),
             "bamba": (("mamba", "full_attention", "mamba"), (1,), (8, 16, 32, 1, 3), ()),
             "nemotron_h": (("mamba", "mlp", "full_attention", "mamba", "mlp"), (2,), (8, 8, 16, 2, 4),
                            (False, True, False, False, True)),
             "nemotron_h_moe": (("mamba", "mlp", "full_attention", "mamba", "mlp"), (2,), (8, 8, 16, 2, 4),
                                (False, True, False, False, True)),
             "falcon_h1": (("hybrid", "hybrid"), (0, 1), (4, 16, 16, 2, 4), ()),
             "mamba2": (("mamba",) * 3, (), (8, 16, 16, 2, 4), (False,) * 3),
             "nemotron_h_latent": (("mamba", "mlp", "full_attention"), (2,), (8, 8, 16, 2, 4), (False, True, False)),
             "falcon_h1_normed": (("hybrid", "hybrid"), (0, 1), (8, 16, 16, 2, 3), ()),
             # (Mamba-1: the channels as heads, one group; dt, B and C from x after the convolution)
             "mamba": (("mamba",) * 3, (), (2, 64, 16, 1, 4), (False,) * 3),
             "falcon_mamba": (("mamba",) * 2, (), (2, 48, 8, 1, 3), (False,) * 2),
             "jamba": (("mamba", "full_attention", "mamba", "full_attention"), (1, 3), (2, 64, 16, 1, 4), ()),
             # (Zamba2: a Mamba-2 mixer in every layer, its hybrid ones' attention blocks before it)
             "zamba2": (("mamba", "zamba", "mamba", "zamba"), (1, 3), (8, 16, 16, 2, 4), (False,) * 4)}
    if tiny.name in mamba:  # (Mamba-2 layers: their conv and state-space states, no KV; Nemotron-H's blocks one
        # mixer or one MLP each)
        types, kv_layers, dims, mlp_layers = mamba[tiny.name]
        layers = sum(t in ("mamba", "hybrid", "zamba") for t in types)
        assert (m.layer_types, m.kv_layers, m.mlp_layers) == (types, kv_layers, mlp_layers)
        assert (m.mamba_heads, m.mamba_head_dim, m.mamba_state, m.mamba_groups, m.mamba_conv_kernel) == dims
        heads, head_dim, state, groups, taps = dims
        kv = load_export(tiny.export_dir).kv
        version = 1 if tiny.name in ("mamba", "falcon_mamba", "jamba") else 2
        assert [(s.past, s.count, s.shape) for s in kv.states] == [
            ("past_mamba_conv.{i}", layers, (taps - 1, heads * head_dim + (2 * groups * state if version == 2 else 0))),
            ("past_ssm.{i}", layers, (heads, state, head_dim))]
        assert (m.mamba_version, m.mamba_dt_rank, m.mamba_bcdt_norm, m.mamba_norm_eps) == {
            "mamba": (1, 8, False, 0.0), "falcon_mamba": (1, 6, True, 1e-5), "jamba": (1, 32, True, 0.0),
            "zamba2": (2, 0, False, 1e-5)}.get(tiny.name, (2, 0, False, 0.0))
        assert (m.mamba_dt_min, m.attention_scale) == ((1e-9, 0.25) if tiny.name == "zamba2" else
                                                       (0.0, m.attention_scale))
        if tiny.name == "zamba2":  # (its two shared blocks, stored once each; each use's adapters its own)
            assert m.zamba_blocks == (-1, 0, -1, 1)
            names = {i.name for i in onnx.load(str(tiny.export_dir / "decode.onnx"),
                                               load_external_data=False).graph.initializer}
            assert {n for n in names if n.startswith("shared.")} == {
                f"shared.{b}.{w}.weight" for b in (0, 1) for w in ("zamba_in", "qkv", "o", "zamba_mid", "gate_up",
                                                                    "down")}
            assert {f"layers.{i}.{a}_adapter_{s}.weight" for i in (1, 3) for a in ("qkv", "gate_up")
                    for s in "ab"} <= names and "layers.1.qkv.weight" not in names
        rotated = tiny.name.startswith(("bamba", "granitemoehybrid_dense", "falcon_h1", "zamba2"))  # (Granite 4.0-H "nope",
        # Nemotron-H, Jamba: no layer)
        assert m.rope_layers == (() if rotated else (False,) * m.num_layers)
        assert m.mamba_norm == {"falcon_h1": "none", "falcon_h1_normed": "before_gate"}.get(tiny.name, "after_gate")
        assert m.moe_latent_size == (32 if tiny.name == "nemotron_h_latent" else 0)
        if tiny.name == "falcon_h1":  # (the muP multipliers of the embeddings and the head; the others folded)
            assert (m.embedding_scale, m.logits_scaling) == (2.0, 2.0)
    else:
        assert m.mamba_heads == 0 and "mamba" not in m.layer_types and not m.mlp_layers
    assert m.linear_kind == ("kda" if tiny.name == "kimi_linear" else "gated_delta")
    if tiny.name != "olmo_hybrid":
        assert (m.norm_layouts, m.linear_beta_scale, m.linear_norm_eps) == ((), 1.0, 0.0)
    if not tiny.name.startswith(("qwen3_5", "qwen3_next", "lara_mini", "kimi_linear", "olmo_hybrid")):
        assert m.linear_conv_kernel == 0 and "linear_attention" not in m.layer_types
    assert m.embed_norm is (tiny.name == "nanochat")
    moe = ("mixtral", "granitemoe", "qwen2_moe", "qwen3_moe", "gpt_oss", "olmoe", "ernie4_5_moe", "hunyuan_v1_moe",
           "granitemoeshared", "granitemoe_swa", "dbrx", "cohere2_moe", "phimoe", "llama4_text", "qwen3_5_moe_text",
           "qwen3_next", "lara_mini", "granitemoehybrid", "jamba", "gemma4_moe", "jetmoe")
    assert (m.num_experts, m.experts_per_token) == ((4, 2) if tiny.name in moe else
                                                    (8, 2) if tiny.name in ("glm4_moe", "minimax_m2", "afmoe",
                                                                            "solar_open", "flex_olmo",
                                                                            "exaone_moe", "minicpm5_moe", "mellum",
                                                                            "flint", "hy_v3", "kolibri1", "kolibri1_1",
                                                                            "mimo_v2_flash", "laguna", "lfm2_moe",
                                                                            "nemotron_h_moe", "nemotron_h_latent")
                                                    or mla_moe else
                                                    (8, 3) if tiny.name == "dots1" else (0, 0))
    assert (m.moe_routing, m.moe_groups, m.moe_topk_groups, m.routed_scaling) == {
        "glm4_moe": ("sigmoid", 4, 2, 2.5), "dots1": ("sigmoid", 2, 1, 1.5), "deepseek_v3": ("sigmoid", 4, 2, 2.5),
        "glm4_moe_lite": ("sigmoid", 2, 1, 1.8), "deepseek_v2": ("softmax_grouped", 4, 1, 1.5),
        "minimax_m2": ("sigmoid", 1, 1, 1.0), "afmoe": ("sigmoid", 1, 1, 1.5), "solar_open": ("sigmoid", 2, 1, 1.5),
        "exaone_moe": ("sigmoid", 2, 1, 2.5), "minicpm5_moe": ("sigmoid", 2, 1, 2.0), "flint": ("sigmoid", 1, 1, 1.0),
        "hy_v3": ("sigmoid", 1, 1, 2.0), "kolibri1": ("sigmoid_logits", 1, 1, 1.0),
        "kolibri1_1": ("sigmoid_logits", 1, 1, 1.0),
        "cohere2_moe": ("sigmoid", 1, 1, 1.0), "phimoe": ("sparsemixer", 1, 1, 1.0),
        "llama4_text": ("sigmoid_logits", 1, 1, 1.0), "mimo_v2_flash": ("sigmoid", 2, 1, 1.5),
        "laguna": ("sigmoid", 1, 1, 1.5), "lfm2_moe": ("sigmoid", 1, 1, 1.5), "kimi_linear": ("sigmoid", 2, 1, 1.5),
        "nemotron_h_moe": ("sigmoid", 2, 1, 1.5), "nemotron_h_latent": ("sigmoid", 2, 1, 1.5), **{n: ("sigmoid", 2, 1, 2.0) for n in (*SPARSE_INDEXED, "axk1")},
        "ernie4_5_moe": ("softmax_biased", 1, 1, 1.0)}.get(tiny.name, ("softmax", 1, 1, 1.0))
    assert (m.attn_sinks, m.moe_bias, m.moe_activation) == ((True, True, "swiglu_oss") if tiny.name == "gpt_oss"
                                                            else (True, False, "silu") if tiny.name in
                                                            ("granite_swa", "granitemoe_swa", "flint",
                                                             "mimo_v2_flash")
                                                            else (False, False, "relu2")
                                                            if tiny.name.startswith("nemotron_h_")
                                                            else (False, False, "gelu_tanh") if tiny.name == "gemma4_moe"
                                                            else (False, True, "silu") if tiny.name == "jetmoe"
                                                            else (False, False, "silu"))
    assert m.moe_beside_mlp is (tiny.name == "gemma4_moe")
    # (BitNet: norms before o and down; its ternary checkpoints: tests/export/test_bitnet.py)
    assert (m.sub_norms, m.act_quant) == ((True, "") if tiny.name == "bitnet" else (False, ""))
    # (JetMoE's mixture of attention: 4 experts' queries, the top 2 per token, 2 KV heads -> 4 query heads)
    assert (m.moa_experts, m.moa_top_k) == ((4, 2) if tiny.name == "jetmoe" else (0, 0))
    assert m.moe_layers == ((True, False) if tiny.name in ("qwen2_moe", "qwen3_moe") else
                            (False, True, True) if tiny.name == "qwen3_next" else
                            (False, True) if tiny.name in ("glm4_moe", "dots1", "ernie4_5_moe", "exaone_moe",
                                                           "minicpm5_moe", "mellum", "flint", "hy_v3",
                                                           "mimo_v2_flash", "laguna")
                            or (mla_moe and tiny.name != "kimi_linear")
                            else
                            (False, True, True) if tiny.name in ("afmoe", "cohere2_moe", "llama4_text", "lfm2_moe",
                                                                 "kimi_linear")
                            else (False, True, False, False, False) if tiny.name == "nemotron_h_moe"
                            else (False, True, False) if tiny.name == "nemotron_h_latent"
                            else (True, False, True, False) if tiny.name == "jamba"
                            else (False, True, True, True, True) if tiny.name == "kolibri1_1"  # (mlp_only_layers)
                            else ())
    assert m.moe_norm_eps == (1e-6 if tiny.name == "lfm2_moe" else 1e-20)
    assert (m.shared_expert_size, m.shared_expert_gated) == {"qwen2_moe": (64, True), "glm4_moe": (32, False),
                                                             "qwen3_5_moe_text": (32, True), "qwen3_next": (32, True),
                                                             "lara_mini": (32, False),
                                                             "dots1": (64, False), "ernie4_5_moe": (32, False),
                                                             "hunyuan_v1_moe": (96, False),
                                                             "granitemoeshared": (64, False),
                                                             "granitemoe_swa": (32, False),
                                                             "granitemoehybrid": (64, False),
                                                             "kimi_linear": (32, False),
                                                             "nemotron_h_moe": (64, False),
                                                             "nemotron_h_latent": (64, False),
                                                             "cohere2_moe": (96, False), "llama4_text": (32, False),
                                                             **{n: (32, False) for n in (*ARCH_MLA, "afmoe",
                                                                                        "solar_open", "exaone_moe",
                                                                                        "minicpm5_moe", "flint",
                                                                                        "hy_v3", "kolibri1", "kolibri1_1", "laguna")
                                                                if n not in MLA_DENSE}}.get(
        tiny.name, (0, True))
    assert m.norm_layout == {"gemma2": "sandwich", "gemma3_text": "sandwich", "glm4": "sandwich",
                             "olmo2": "post", "olmo3": "post", "exaone4": "post", "afmoe": "sandwich",
                             "flex_olmo": "post", "hyperclovax": "sandwich", "kolibri1": "sandwich", "kolibri1_1": "sandwich",
                             "lfm3": "sandwich", "gemma4_text": "sandwich",
                             "gemma4_e": "sandwich", "gemma4_moe": "sandwich"}.get(tiny.name,
                                                                                                           "pre")


def _external_refs(model_path: Path) -> dict[str, tuple[str, int, int]]:
    """initializer name -> (location, offset, length) for every initializer stored as external data."""
    model = onnx.load(str(model_path), load_external_data=False)
    refs = {}
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in init.external_data}
            refs[init.name] = (info["location"], int(info.get("offset", 0)), int(info["length"]))
    return refs


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay != "concat"])
def test_inplace_engines_run_one_graph_in_one_session(tiny: Built, layout: str) -> None:
    """Prefill and decode are one graph (logits at each row's last new token), so ONNX Runtime prepacks and holds
    the weights once; the parity tests above run it for prompts, one-token steps and prompt chunks."""
    engine = load_engine_dir(tiny.engine(layout))
    spec = engine.manifest.prefill
    assert engine.manifest.decode == spec and spec.file == "model.onnx" and spec.logits == "last"
    assert engine._decode is engine._prefill  # type: ignore[attr-defined]


@pytest.mark.parametrize("stage", ["export", *LAYOUTS])
def test_weights_stored_once(tiny: Built, hf: Any, stage: str) -> None:
    folder = tiny.export_dir if stage == "export" else tiny.engine(stage)
    weights = folder / "weights.bin"
    assert weights.is_file()
    assert not list(folder.glob("*.data")), "a second external-data file"
    size = weights.stat().st_size
    graphs = sorted(folder.glob("*.onnx"))  # export / concat: prefill + decode; in-place engines: one model.onnx
    assert len(graphs) == (1 if stage in ("gqa", "onnx", "llmc", "onnx-static") else 2), graphs
    refs = [_external_refs(g) for g in graphs]
    for graph_refs in refs:
        assert graph_refs, "graph holds no external weights"
        assert {loc for loc, _, _ in graph_refs.values()} == {"weights.bin"}
        assert all(off % ALIGN == 0 and off + n <= size for _, off, n in graph_refs.values())
    for name in refs[0].keys() & refs[-1].keys():  # the same tensor, the same bytes on disk (not the constants
        # ONNX Runtime folded, named by the node that made them, whose numbers differ between the two graphs)
        if not re.search(r"_out\d+$", name):
            assert refs[0][name] == refs[-1][name], name
    param_bytes = 4 * sum(p.numel() for p in hf.parameters())
    distinct = {(off, n) for r in refs for _, off, n in r.values()}
    assert size <= param_bytes + ALIGN * len(distinct), f"{size} bytes for {param_bytes} bytes of parameters"
    if stage == "export":
        assert size >= 0.9 * param_bytes
    for g in graphs:  # the graphs themselves hold no weights
        assert g.stat().st_size < 0.25 * param_bytes


def test_the_reference_runs_the_models_own_attention(tiny_factory: Callable[[str], Built]) -> None:
    """Parity is checked against each model's eager attention, its definition: transformers' default backend may
    leave a feature out (5.17 ran Gemma 2 through SDPA, which drops its attention softcap: 2.3e-3 off)."""
    from llmc.export import sources

    src = sources.resolve(str(tiny_factory("llama").hf_dir))
    assert sources.load(src).model.config._attn_implementation == "eager"
    assert sources.load(src, attention=None).model.config._attn_implementation != "eager"  # transformers' default


def _zamba2_export(folder: Path, **changes: Any) -> tuple[Any, Any]:
    """The tiny Zamba2 with config changes, saved and exported into folder: (the transformers model, the manifest)."""
    import transformers as tf
    from tiny_models import _zamba2, make_tokenizer

    from llmc.export.exporter import ExportConfig, export

    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = _zamba2(tf, common, **changes)
    with torch.no_grad():  # (as make_model widens them: the mixers' outputs then show in the logits)
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(str(folder / "hf"))
    make_tokenizer(folder / "hf", 320)
    return model, export(ExportConfig(str(folder / "hf"), folder / "out"))


def test_zamba2_s_dt_clamp_is_its_trained_scan_s(tmp_path: Path) -> None:
    """Zamba2's dt is at least time_step_min after its softplus (its mixers' time_step_limit, as the trained and the
    prompt's scan clamp it): with a minimum that binds on most tokens, the export (prompt and one-token steps) gives
    transformers' full-sequence logits, which differ from the unclamped model's."""
    model, manifest = _zamba2_export(tmp_path, time_step_min=1.0)
    assert manifest.model.mamba_dt_min == 1.0 and manifest.parity["max_abs_diff"] <= 1e-4
    ids = torch.tensor([_ids(3, 12)])
    with torch.no_grad():
        clamped = model(ids).logits
        for mixer in (layer.mamba if hasattr(layer, "mamba") else layer.mamba_decoder.mamba
                      for layer in model.model.layers):
            mixer.time_step_limit = (0.0, float("inf"))
        free = model(ids).logits
    assert float((clamped - free).abs().max()) > 1e-2  # (the clamp binds)



def test_a_zamba2_block_used_twice_is_stored_once_and_streamed_twice(tmp_path: Path) -> None:
    """Both hybrid layers on one shared block (num_mem_blocks 1): exact, stored once (a smaller weights file than
    with a block each), and a decode step's weight bytes the same as with a block each (each use streams it)."""
    from llmc.bench.limits import weight_bytes_per_step
    from llmc.engines.ort.build import BuildConfig, build_ort

    sizes, steps = {}, {}
    for blocks in (1, 2):
        _, manifest = _zamba2_export(tmp_path / str(blocks), num_mem_blocks=blocks)
        assert manifest.model.zamba_blocks == ((-1, 0, -1, 0) if blocks == 1 else (-1, 0, -1, 1))
        assert manifest.parity["max_abs_diff"] <= 1e-4
        engine = build_ort(BuildConfig(tmp_path / str(blocks) / "out", tmp_path / str(blocks) / "engine"))
        sizes[blocks] = (tmp_path / str(blocks) / "out" / "weights.bin").stat().st_size
        steps[blocks] = weight_bytes_per_step(tmp_path / str(blocks) / "engine", engine)
    assert sizes[1] < sizes[2] and steps[1] == steps[2]
