"""transformers (eager, fp32) on the same prompts, in the same run: the peer `--compare-torch` measures."""

from __future__ import annotations

import time
from typing import Any

from llmc.errors import InputError


def torch_decode(source: str, prompts: list[list[int]], new_tokens: int, threads: int) -> dict[str, float]:
    """TTFT (one forward over the prompts) and decode tokens/s per sequence of `generate` (greedy, no EOS)."""
    try:
        import torch

        from llmc.export import sources
    except ImportError:
        raise InputError("--compare-torch needs the export extra: pip install 'llmc[export]'") from None
    torch.set_num_threads(threads)
    model = sources.load(sources.resolve(source)).model
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    kwargs: dict[str, Any] = {"attention_mask": mask, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **{**kwargs, "attention_mask": mask[:, :8]})
        t0 = time.perf_counter()
        model(ids, attention_mask=mask)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - t0
    assert out.shape[1] - ids.shape[1] == new_tokens
    decode = max(total - ttft, 1e-9)
    return {"torch_ttft_ms": round(ttft * 1e3, 2), "torch_decode_tok_s_per_seq": round((new_tokens - 1) / decode, 1)}
