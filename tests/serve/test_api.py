"""The OpenAI-compatible endpoints, driven by the real `openai` client."""

from __future__ import annotations

import json

import httpx
import pytest

from llmc import __version__
from llmc.runtime.config import RuntimeConfig

from .conftest import MODEL, Server

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model_with_its_context(server: Server) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == server.engine.max_model_len == 256  # type: ignore[attr-defined]


def test_health_version_and_metrics_answer(server: Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    text = httpx.get(server.url + "/metrics").text
    for name in ("llmc_num_requests_running", "llmc_num_requests_waiting", "llmc_kv_cache_usage_perc",
                 "llmc_time_to_first_token_seconds", "llmc_inter_token_latency_seconds",
                 "llmc_time_per_output_token_seconds", "llmc_e2e_request_latency_seconds",
                 "llmc_request_queue_time_seconds", "llmc_prompt_tokens_total", "llmc_generation_tokens_total",
                 "llmc_kv_blocks_used", "llmc_kv_blocks_cached", "llmc_kv_blocks_total", "llmc_prefix_cache_hit_rate",
                 "llmc_prefix_cache_hit_tokens", "llmc_prefix_cache_queried_tokens", "llmc_num_preemptions"):
        assert name in text


def test_chat_completion_matches_the_engine_alone(server: Server) -> None:
    r = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    ids = server.llm.encode_chat(CHAT)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(ids) + 12
    expected = server.llm.tokenizer.decode(_greedy(server, ids, 12))
    assert choice.message.content == expected


def _greedy(server: Server, ids: list[int], n: int) -> list[int]:
    """Greedy tokens computed with the engine directly (the server's engine thread is idle meanwhile)."""
    import numpy as np

    from llmc.runtime.generator import EngineLoop

    loop = EngineLoop(server.llm.engine, server.llm.tokenizer, RuntimeConfig(max_running=1, kv_budget_mb=16))
    kv, out = server.llm.engine.new_kv_cache(1, loop.max_len), []  # (the loop's KV memory is its block manager's)
    logits = server.llm.engine.prefill([0], [ids], kv)
    for _ in range(n):
        out.append(int(np.argmax(logits[0])))
        logits = server.llm.engine.decode([0], [[out[-1]]], kv)
    return out


def test_completion_with_text_and_token_id_prompts(server: Server) -> None:
    client = server.client()
    a = client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=8, temperature=0)
    ids = server.llm.encode("The capital of France")
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert a.object == "text_completion"
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids)
    assert a.choices[0].finish_reason in ("stop", "length")


def test_completion_batch_of_prompts_numbers_choices_by_prompt_then_n(server: Server) -> None:
    r = server.client().completions.create(model=MODEL, prompt=["Hello", "The capital"], n=2, max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = server.client().completions.create(model=MODEL, prompt="The capital", max_tokens=4, temperature=0)
    assert r.choices[2].text == r.choices[3].text == alone.choices[0].text
    assert r.usage.completion_tokens == 16


def test_n_returns_n_choices_with_seeded_sampling(server: Server) -> None:
    client = server.client()
    kw = dict(model=MODEL, messages=CHAT, max_tokens=10, n=2, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    r1, r2 = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert sorted(c.index for c in r1.choices) == [0, 1]
    assert [c.message.content for c in r1.choices] == [c.message.content for c in r2.choices]
    assert r1.usage.completion_tokens == 20


def test_chat_stream_sends_role_then_deltas_then_done(server: Server) -> None:
    stream = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    full = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content


def test_stream_include_usage_adds_a_usage_chunk_before_done(server: Server) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert all(json.loads(x[6:])["object"] == "text_completion" for x in lines[:-1])
    chat = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
    chunks = list(chat)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_chat_logprobs_in_openai_format(server: Server) -> None:
    r = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy: the best one
        assert item.bytes == list(item.token.encode())


def test_completion_logprobs_in_openai_format(server: Server) -> None:
    r = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0


def test_streamed_logprobs_cover_every_token(server: Server) -> None:
    stream = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                     logprobs=True, top_logprobs=1, stream=True,
                                                     extra_body={"ignore_eos": True})
    items = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert len(items) == 6


def test_stop_string_and_stop_token_ids(server: Server) -> None:
    client = server.client()
    base = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[2:4] if len(text) >= 4 else text[-1:]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    first = server.llm.encode("Hello")
    tok = _greedy(server, first, 1)[0]
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": [tok], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1


def test_metrics_count_tokens_and_finished_requests(server: Server) -> None:
    before = server.metrics()
    r = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=7, temperature=0,
                                           extra_body={"ignore_eos": True})
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("llmc_generation_tokens_total") == 7
    assert delta("llmc_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta('llmc_request_success_total{finished_reason="length"}') == 1
    assert delta("llmc_e2e_request_latency_seconds_count") == 1
    assert delta("llmc_time_to_first_token_seconds_count") == 1
    assert delta("llmc_inter_token_latency_seconds_count") == 6
    assert after["llmc_num_requests_running"] == 0 and after["llmc_kv_cache_usage_perc"] == 0


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_metrics_count_them(server: Server) -> None:
    messages = [{"role": "system", "content": "Answer in one word, and be kind about it. " * 3}, *CHAT]

    def hits() -> float:
        return next(v for k, v in server.metrics().items() if k.startswith("llmc_prefix_cache_hit_tokens"))

    before = hits()
    usages = [server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                      temperature=0).usage for _ in range(2)]
    assert usages[0] is not None and usages[1] is not None
    details = [u.prompt_tokens_details for u in usages]
    assert details[0] is not None and details[1] is not None
    n = usages[1].prompt_tokens
    if server.engine.loop.scheduler.config.prefix_caching:  # type: ignore[attr-defined]
        block = server.engine.loop.scheduler.config.block_size  # type: ignore[attr-defined]
        assert details[1].cached_tokens == (n - 1) // block * block > 0  # all but the last token, to a block edge
        assert hits() - before >= details[1].cached_tokens
        assert next(v for k, v in server.metrics().items() if k.startswith("llmc_kv_blocks_total")) > 0
    else:  # an engine that keeps the slot layout (GroupQueryAttention where llmc's operator does not run)
        assert details[1].cached_tokens == 0 and hits() == before == 0
