"""Check an engine against the golden outputs that transformers produced at export."""

from __future__ import annotations

import numpy as np

from llmc.engines.base import Engine
from llmc.golden import Golden


def check_golden(engine: Engine, golden: Golden) -> dict[str, float]:
    """Teacher-force the golden prompt and continuation through prefill + decode; compare every step's logits.

    Returns max |logit diff|, top-1 agreement over the steps, and how many leading greedy tokens match.
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
    return {
        "max_abs_diff": float(np.abs(ours - ref).max()),
        "top1_agreement": float(top1.mean()),
        "greedy_match": float(match_len),
    }
