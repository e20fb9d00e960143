"""What rounding the KV cache to int8 costs a model's next-token distribution, measured in transformers
(docs/quantization.md, "The int8 KV cache's keys through a Hadamard matrix"): the keys and values each layer's
attention sees are rounded as a form of int8 cache would round them, and the logits at every position of a few
prompts (chat prompts with the model's greedy continuation, prose, code) are compared with unrounded fp32 ones.

    .venv/bin/python scripts/kv_int8_error.py [--model MODEL] [FORM ...]

MODEL: what `llmc export` takes (default: the default model). FORM: comma-separated parts, e.g. "k,v" (keys and
values as the cache kept them before contract 12: int8, an fp16 scale per 32), "hk,v" (the keys times the 32-point
Hadamard matrix first: llmc's cache now):
  k / v          int8 with an fp16 scale per group of 32 of a row (kN: groups of N; a trailing "a": with a zero point)
  hk / hv        the same after the 32-point orthonormal Hadamard matrix on each 32 of the row (Hk: the whole head's)
  kcN            keys per channel over groups of N positions (a trailing "a": with a zero point)
  skA            keys divided and queries multiplied per channel pair by max|k|^A / max|q|^(1-A), then int8
  hqN            the queries through the 32-point matrix and rounded to int8 per N (what int8 scores would do)
One line per form: mean and max KL against fp32 and top-1 agreement. Needs the export extra (torch, transformers).
"""

from __future__ import annotations

import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from llmc.engines.ort.quality import CALIBRATION_PROMPTS
from llmc.export.sources import load, resolve

PROSE = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
         "metal type with an oil-based ink and a wooden screw press. Within fifty years presses operated in more than "
         "two hundred cities across Europe, and the cost of books fell sharply. Scholars debate how much the press "
         "contributed to the Reformation and to the scientific revolution.")
CODE = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
        "        self.items.append(x)\n")


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def rounded(x: torch.Tensor, group: int, zero_point: bool) -> torch.Tensor:
    """x [..., n] rounded to int8 per group of `group` along its last dim, fp16 scale (and zero point)."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    if zero_point:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        s, lo = _fp16((hi - lo) / 255), _fp16(lo)
        q = torch.round((g - lo) / torch.where(s > 0, s, 1)).clamp(0, 255)
        return (q * s + lo).reshape(x.shape)
    s = _fp16(g.abs().amax(-1, keepdim=True) / 127)
    q = torch.round(g / torch.where(s > 0, s, 1)).clamp(-127, 127)
    return (q * s).reshape(x.shape)


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def form_of(part: str) -> tuple[str, str, int, bool]:
    """(tensor "k" / "v", kind, group, zero point) of one part of a FORM."""
    zero = part.endswith("a")
    part = part.rstrip("a") if zero else part
    if part.startswith("kc"):
        return "k", "channel", int(part[2:]), zero
    if part[0] in "hH":
        return part[1], "hadamard32" if part[0] == "h" else "hadamard", int(part[2:] or 32), zero
    return part[0], "row", int(part[1:] or 32), zero


def apply(x: torch.Tensor, kind: str, group: int, zero: bool) -> torch.Tensor:
    """x [B, heads, T, D] as the cache form would give it back."""
    if kind == "channel":  # per channel over positions: round x^T, padded to whole groups
        t = x.transpose(-1, -2)
        pad = (-t.shape[-1]) % group
        return rounded(torch.nn.functional.pad(t, (0, pad)), group, zero)[..., :t.shape[-1]].transpose(-1, -2)
    if kind.startswith("hadamard"):
        n = 32 if kind == "hadamard32" else x.shape[-1]
        h = torch.block_diag(*[hadamard(n)] * (x.shape[-1] // n))
        return rounded(x @ h, group, zero) @ h.T
    return rounded(x, group, zero)


def main(argv: list[str]) -> None:
    model_ref = argv[argv.index("--model") + 1] if "--model" in argv else "SmolLM2-135M-Instruct"
    forms = [a for i, a in enumerate(argv) if a != "--model" and (i == 0 or argv[i - 1] != "--model")]
    forms = forms or ["k,v", "hk,v"]
    loaded = load(resolve(model_ref))
    model, tok = loaded.model, loaded.tokenizer
    prompts = []
    for text in [*CALIBRATION_PROMPTS, PROSE, CODE]:
        chat = text in CALIBRATION_PROMPTS
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            prompts.append(model.generate(ids, max_new_tokens=48, do_sample=False) if chat else ids)

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    state: dict = {"parts": [], "smooth": None, "q": 0, "stats": {}, "collect": True}

    def attention(module, query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        layer = module.layer_idx
        if state["collect"]:  # the fp32 pass: each channel's largest |k| and |q|
            km, qm = key.abs().amax(2)[0], query.abs().amax(2)[0]
            old = state["stats"].get(layer)
            state["stats"][layer] = (km, qm) if old is None else (torch.maximum(old[0], km), torch.maximum(old[1], qm))
        if state["smooth"] is not None:
            s = state["smooth"][layer]
            key = key / s[None, :, None, :]
            query = query * s.repeat_interleave(query.shape[1] // key.shape[1], 0)[None, :, None, :]
        if state["q"]:  # the queries through the 32-point matrix, rounded to int8 per state["q"], and back
            h = torch.block_diag(*[hadamard(32)] * (query.shape[-1] // 32))
            query = rounded(query @ h, state["q"], False) @ h.T
        for which, kind, group, zero in state["parts"]:
            if which == "k":
                key = apply(key, kind, group, zero)
            else:
                value = apply(value, kind, group, zero)
        return sdpa(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["llmc_kv_int8_error"] = attention
    model.config._attn_implementation = "llmc_kv_int8_error"

    def logits() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(ids).logits[0].float() for ids in prompts]

    reference = logits()
    state["collect"] = False
    for form in forms:
        state["parts"], state["smooth"], state["q"] = [], None, 0
        for part in form.split(","):
            if part.startswith("hq"):
                state["q"] = int(part[2:] or 32)
            elif part.startswith("sk"):
                alpha, smooth = float(part[2:]), {}
                for layer, (km, qm) in state["stats"].items():
                    hkv, d = km.shape
                    qk = qm.reshape(hkv, -1, d).amax(1)
                    s = km.clamp(min=1e-5) ** alpha / qk.clamp(min=1e-5) ** (1 - alpha)
                    s = torch.maximum(s[:, :d // 2], s[:, d // 2:])  # one factor a rotary pair
                    smooth[layer] = torch.cat([s, s], 1)
                state["smooth"] = smooth
                state["parts"].append(("k", "row", 32, False))
            else:
                state["parts"].append(form_of(part))
        kl, agree = [], []
        for r, g in zip(reference, logits()):
            lp, lq = torch.log_softmax(r, -1), torch.log_softmax(g, -1)
            kl.append((lp.exp() * (lp - lq)).sum(-1))
            agree.append((r.argmax(-1) == g.argmax(-1)).float())
        k, a = torch.cat(kl), torch.cat(agree)
        print(f"{form:24s} mean KL {k.mean():.2e}  max KL {k.max():.2e}  top-1 {100 * a.mean():.2f} %  "
              f"({len(k)} positions)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
