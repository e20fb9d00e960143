"""Check an engine against the golden outputs that transformers produced at export."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.engines.base import Engine
from llmc.golden import Golden


def check_golden(engine: Engine, golden: Golden) -> dict[str, float]:
    """Teacher-force the golden prompt and continuation through prefill + decode; compare every step's logits.

    Returns max |logit diff|, top-1 agreement over the steps, how many leading greedy tokens match and, when one
    differs, where (`diverged_at`) and the two tokens (`engine_token`, `golden_token`).
    """
    kv = engine.new_kv_cache(1, len(golden.input_ids) + len(golden.continuation) + 1)
    steps = [engine.prefill([0], [golden.input_ids.tolist()], kv)[0]]
    for token in golden.continuation.tolist():
        steps.append(engine.decode([0], [[int(token)]], kv)[0])
    ours = np.stack(steps).astype(np.float32)  # [K + 1, V]
    ref = golden.logits
    top1 = ours.argmax(-1) == ref.argmax(-1)
    greedy = ours[:-1].argmax(-1) == golden.continuation
    match_len = int(np.argmin(greedy)) if not greedy.all() else len(greedy)
    report = {
        "max_abs_diff": float(np.abs(ours - ref).max()),
        "top1_agreement": float(top1.mean()),
        "greedy_match": float(match_len),
    }
    if match_len < len(greedy):
        report.update(diverged_at=float(match_len), engine_token=float(ours[match_len].argmax()),
                      golden_token=float(golden.continuation[match_len]))
    return report


Trace = tuple[np.ndarray, list[int]]  # next-token logits [steps + 1, V] along a greedy continuation, and its tokens

# A fixed, varied prompt set: facts, code, arithmetic, instructions, multilingual, long-ish context.
VERIFY_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 times 23? Show your steps.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "List three tips for a good night's sleep.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Give me a short poem about the sea.",
)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64."""
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _forced(engine: Engine, prompt: list[int], tokens: list[int], steps: int) -> np.ndarray:
    """Next-token logits after the prompt and after each of its first `steps` tokens (teacher-forced), the prompt
    alone."""
    kv = engine.new_kv_cache(1, len(prompt) + steps + 1)
    logits = [engine.prefill([0], [prompt], kv)[0]]
    for token in tokens[:steps]:
        logits.append(engine.decode([0], [[token]], kv)[0])
    return np.stack(logits)


def greedy_traces(engine: Engine, prompts: list[list[int]], steps: int) -> list[Trace]:
    """The engine's greedy continuation of each prompt and the next-token logits along it, the prompts as one batch
    (_batched: the fp32 reference at 0.5 B parameters, 8 verify prompts x 32 steps, 23.6 -> 8.3 s against each
    prompt alone; the same tokens, logits within 5e-6)."""
    return _batched(engine, prompts, None, steps)


def _batched(engine: Engine, prompts: list[list[int]], tokens: list[list[int]] | None, steps: int) -> list[Trace]:
    """Each prompt's next-token logits along its `tokens` (greedy where None) and those tokens, all the prompts in
    one batch: one prefill of them all, then one decode step of every row at a time (as a server's batch runs them),
    so each step reads the weights once for every row."""
    kv = engine.new_kv_cache(len(prompts), max(map(len, prompts)) + steps + 1)
    rows = list(range(len(prompts)))
    logits = [list(engine.prefill(rows, prompts, kv))]
    chosen: list[list[int]] = [[] for _ in rows]
    for i in range(steps):
        for r in rows:
            chosen[r].append(int(np.argmax(logits[-1][r])) if tokens is None else tokens[r][i])
        logits.append(list(engine.decode(rows, [[t[-1]] for t in chosen], kv)))
    return [(np.stack([step[r] for step in logits]), chosen[r]) for r in rows]


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """A prompt of the fixed sets as a user turn of the model's chat template (raw text when it has none)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))


def _scores(refs: list[tuple[np.ndarray, list[int]]], candidates: list[np.ndarray], steps: int) -> dict[str, float]:
    agree, kls, match = [], [], []
    for (ref_logits, ref_tokens), cand_logits in zip(refs, candidates):
        ref_top, cand_top = ref_logits.argmax(-1), cand_logits.argmax(-1)
        agree.append(ref_top == cand_top)
        p_log, q_log = log_softmax(ref_logits), log_softmax(cand_logits)
        kls.append((np.exp(p_log) * (p_log - q_log)).sum(-1))
        diverge = np.nonzero(cand_top[:-1] != np.array(ref_tokens))[0]
        match.append(int(diverge[0]) if diverge.size else steps)
    return {"top1_agreement": float(np.concatenate(agree).mean()), "mean_kl": float(np.concatenate(kls).mean()),
            "greedy_match_mean": float(np.mean(match)), "greedy_match_min": float(np.min(match)),
            "positions": float(sum(a.size for a in agree))}




def reference_traces(reference: Engine, prompts: list[list[int]], steps: int = 32) -> list[Trace]:
    """The reference's greedy continuation of each prompt and its next-token logits along it: what compare_to
    scores a candidate against (computed once, the reference engine can go before the candidates come)."""
    return greedy_traces(reference, prompts, steps) if prompts else []


def compare_to(refs: list[Trace], candidate: Engine, prompts: list[list[int]], together: bool = False) -> dict[str, Any]:
    """Top-1 agreement and mean KL(reference || candidate) of next-token distributions along the reference's own
    greedy continuations (`refs`, from reference_traces on the same prompts), and the mean length over which the
    candidate's greedy output matches the reference's. The candidate runs each prompt alone; `together` also runs
    them all as one batch, the same scores under the key "together" (an engine whose rows depend on their batch, as
    a windowed head's do, differs there)."""
    steps = len(refs[0][1]) if refs else 0
    report: dict[str, Any] = _scores(refs, [_forced(candidate, p, tokens, steps)
                                            for p, (_, tokens) in zip(prompts, refs)], steps)
    if together:
        batch = _batched(candidate, prompts, [t for _, t in refs], steps)
        report["together"] = _scores(refs, [logits for logits, _ in batch], steps)
    return report


def compare_engines(reference: Engine, candidate: Engine, prompts: list[list[int]], steps: int = 32,
                    together: bool = False) -> dict[str, Any]:
    """compare_to over the reference's traces of `prompts`, `steps` tokens each."""
    return compare_to(reference_traces(reference, prompts, steps), candidate, prompts, together)
