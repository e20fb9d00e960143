"""Golden reference outputs: transformers' logits for a fixed prompt, saved at export, checked at every stage."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.golden import GOLDEN_STEPS, Golden

GOLDEN_QUESTION = "What is the capital of France?"
GOLDEN_RAW_PROMPT = "The capital of France is"


def golden_prompt_ids(tokenizer: Any) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": GOLDEN_QUESTION}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(GOLDEN_RAW_PROMPT)["input_ids"])


def make_golden(model: Any, prompt_ids: list[int], steps: int = GOLDEN_STEPS) -> Golden:
    """Greedy continuation and the logits at each step, from transformers itself (fp32)."""
    import torch

    ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        full = out[0]
        logits = model(full[None, :]).logits[0, len(prompt_ids) - 1:]
    return Golden(
        input_ids=np.array(prompt_ids, dtype=np.int64),
        continuation=full[len(prompt_ids):].numpy().astype(np.int64),
        logits=logits.float().numpy(),
    )
