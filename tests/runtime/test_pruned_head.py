"""A head narrower than the vocabulary (Apertus 1.5's, its multimodal rows pruned: ModelSpec.output_vocab_size): the
engines' logits are the head's width, prompts take any id of the vocabulary, only the head's ids are ever generated
(under penalties over prompt ids past it too), a bias on an id past the head is refused by name, and constrained
decoding masks over the tokenizer's ids (llguidance refuses fewer) cut to the head's."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import Built

from llmc.engines.registry import load_engine_dir
from llmc.errors import InputError
from llmc.manifest import ModelSpec, load_engine
from llmc.runtime.llm import LLM, LLMConfig
from llmc.runtime.request import SamplingParams

ARCH = "apertus1p5_text"


@pytest.fixture(scope="module")
def built(tiny_factory: Callable[[str], Built]) -> Built:
    return tiny_factory(ARCH)


@pytest.fixture(scope="module")
def spec(built: Built) -> ModelSpec:
    return load_engine(built.engine("default")).model


@pytest.fixture(scope="module")
def llm(built: Built) -> LLM:
    return LLM(built.engine("default"), LLMConfig(kv_budget_mb=64))


def test_the_logits_are_the_heads_and_follow_transformers_on_pruned_ids(built: Built, spec: ModelSpec,
                                                                         hf_factory: Callable[[Built], Any]) -> None:
    import torch

    assert spec.logits_size == spec.vocab_size - 40 and spec.output_vocab_size == spec.logits_size
    ids = [*range(spec.logits_size, spec.vocab_size, 3), 5, 7, 11]  # ids the head cannot produce, read as inputs
    with torch.no_grad():
        want = hf_factory(built)(torch.tensor([ids])).logits[0, -1].numpy()
    assert want.shape == (spec.logits_size,)
    for layout in ("default", "gqa"):
        engine = load_engine_dir(built.engine(layout))
        kv = engine.new_kv_cache(1, 64)
        got = engine.prefill([0], [ids], kv)
        assert got.shape == (1, spec.logits_size)
        assert float(np.abs(got[0] - want).max()) <= 1e-2 * float(np.abs(want).max())


def test_only_the_heads_ids_are_generated(llm: LLM, spec: ModelSpec) -> None:
    """Every pruned id in the prompt, under a repetition penalty (which reads the prompt's ids: none of these has a
    logit) and hot sampling: each generated id is one of the head's."""
    prompt = [*range(spec.logits_size, spec.vocab_size), 5, 6]
    params = SamplingParams(temperature=3.0, max_tokens=48, seed=0, repetition_penalty=1.3, presence_penalty=0.5,
                            ignore_eos=True)
    tokens = [t for out in llm.generate([prompt, prompt[::-1]], params) for t in out.outputs[0].token_ids]
    assert len(tokens) == 96 and max(tokens) < spec.logits_size
    assert len(set(tokens)) > 20  # (hot enough to reach across the head)


def test_a_bias_reaches_the_heads_last_id_and_is_refused_past_it(llm: LLM, spec: ModelSpec) -> None:
    last = spec.logits_size - 1
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1, logit_bias={last: 100.0}, ignore_eos=True)
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == [last] * 6
    for tid in (spec.logits_size, spec.vocab_size - 1):
        with pytest.raises(InputError, match=f"logit_bias token id {tid} >= vocab size {spec.logits_size} "
                                             rf"\(the model's head produces ids below {spec.logits_size} only\)"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logit_bias={tid: 1.0}))
    with pytest.raises(InputError, match=f"logit_bias token id {spec.vocab_size} >= vocab size {spec.logits_size}$"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logit_bias={spec.vocab_size: 1.0}))
    stop = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop_token_ids=[spec.vocab_size - 1]))[0]
    assert len(stop.outputs[0].token_ids) >= 1  # (a stop id past the head is an id: it just never comes)


def test_constrained_decoding_masks_over_the_tokenizers_ids(llm: LLM, spec: ModelSpec) -> None:
    assert llm.tokenizer is not None and llm.tokenizer.vocab_size == spec.vocab_size > spec.logits_size
    params = SamplingParams(regex="[ab]{6}", max_tokens=16, temperature=1.5, seed=2)
    for out in llm.generate(["x", "y z"], [params, params]):
        assert re.fullmatch("[ab]{6}", out.outputs[0].text), out.outputs[0].text
        assert max(out.outputs[0].token_ids) < spec.logits_size
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = llm.generate(["q"], SamplingParams(json_schema=schema, max_tokens=64, temperature=1.0, seed=3))[0]
    assert max(out.outputs[0].token_ids) < spec.logits_size
