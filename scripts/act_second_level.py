"""Where the 4-bit product's second int8 level of x pays: whole layers (how `--quality-target` raises today) against
single (row, block) pairs chosen by a per-layer threshold on the block's max |x|, simulated in transformers.

The default model's weights are exact on their GGUF Q4_1 grid, so the int8 activations are all of an int4 engine's
error (docs/quantization.md). Every linear layer's input is quantized here as MatMulQ4 does it (blocks of 32 along
K, q = round(x / s), s = max|x| / 127; the second level quantizes what is left the same way), and the model is
scored as `llmc verify` scores an engine: top-1 agreement, mean KL and greedy match over its 8 prompts x 32 greedy
steps of the fp32 model.

1. Calibration (the search's own prompts, not verify's): each engine layer's sensitivity (the mean KL with only it
   at one level; q/k/v and gate/up share an input, so they count as the one product the engine fuses) and the
   max |x| of every block of its input.
2. `layers`: the k most sensitive layers at two levels, as the search raises them.
3. `blocks`: a (row, block) takes the second level where its max |x| passes its layer's threshold t_l, with
   t_l^2 = lam * N_l * E_l / s_l (N_l the layer's output columns, E_l the sum of its calibration blocks' max |x|^2,
   s_l its sensitivity): the blocks whose predicted share of the KL per multiply-add is above lam.

The MAC fractions are of the 134.5 M multiply-adds a token: per row (a kernel that skips the level row by row),
and per group of 4 consecutive rows (the VNNI kernel's row blocks at batch 8, which skip a block only when all 4
rows do).

    python scripts/act_second_level.py --ks 60,80,90,100,110 --lams 3e-12,1e-12,3e-13,1e-13,3e-14
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--ks", default="60,80,90,100,110", help="whole layers raised (most sensitive first)")
    p.add_argument("--lams", default="3e-12,1e-12,3e-13,1e-13,3e-14", help="thresholds for single blocks")
    a = p.parse_args()

    import torch

    from llmc.engines.ort.quality import CALIBRATION_PROMPTS
    from llmc.export import sources
    from llmc.runtime.verify import VERIFY_PROMPTS

    torch.set_num_threads(2)
    loaded = sources.load(sources.resolve(a.model))
    model, tok = loaded.model, loaded.tokenizer
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}

    def product(name: str) -> str:  # the engine's fused product a torch layer belongs to
        for part, fused in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"), ("gate_proj", "gate_up"),
                            ("up_proj", "gate_up")):
            if name.endswith(part):
                return name[: -len(part)] + fused
        return name

    names = sorted({product(n) for n in linear})
    index = {g: i for i, g in enumerate(names)}
    cols, width = np.zeros(len(names)), np.zeros(len(names))
    for n, m in linear.items():
        cols[index[product(n)]] += m.out_features
        width[index[product(n)]] = m.in_features
    macs = cols * width
    first = {n for n in linear if product(n) == n or n.endswith(("q_proj", "gate_proj"))}  # one count a product
    state: dict = {"mode": "fp"}

    def level(x: torch.Tensor) -> torch.Tensor:
        s = x.abs().amax(-1, keepdim=True) / 127
        return torch.round(x / torch.where(s == 0, torch.ones_like(s), s)) * s

    def quantize(x: torch.Tensor, name: str) -> torch.Tensor:
        mode, g = state["mode"], index[product(name)]
        if mode == "fp":
            return x
        blocks = x.reshape(-1, x.shape[-1] // 32, 32)
        if mode == "collect":
            if name in first:
                state["amax2"][g].append((blocks.abs().amax(-1) ** 2).flatten())
            return x
        t = state["threshold"][g]  # 0: two levels everywhere, None: one level, else a threshold on max |x|
        one = level(blocks)
        if t is None:
            return one.reshape(x.shape)
        two = one + level(blocks - one)
        if t == 0:
            return two.reshape(x.shape)
        take = blocks.abs().amax(-1) > t
        if name in first:
            c, per_block = state["count"], macs[g] / take.shape[1]
            c[0] += per_block * float(take.sum())
            c[1] += macs[g] * take.shape[0]
            rows = take.shape[0] // 4 * 4
            c[2] += per_block * 4 * float(take[:rows].reshape(-1, 4, take.shape[1]).any(1).sum())
        return torch.where(take[..., None], two, one).reshape(x.shape)

    for n, m in linear.items():
        m.register_forward_pre_hook(lambda mod, args, n=n: (quantize(args[0], n),))

    def ids(prompt: str) -> list[int]:
        r = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True)
        return list(r["input_ids"] if hasattr(r, "keys") else r)

    def references(prompts: tuple[str, ...], steps: int) -> list:
        state["mode"], out = "fp", []
        with torch.no_grad():
            for prompt in map(ids, prompts):
                seq = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps,
                                     do_sample=False)[0].tolist()
                logits = model(torch.tensor([seq])).logits[0, len(prompt) - 1:len(prompt) + steps].double()
                out.append((seq, len(prompt), torch.log_softmax(logits, -1)))
        return out

    def score(refs: list, threshold: list, steps: int) -> dict:
        state.update(mode="q", threshold=threshold, count=[0.0, 0.0, 0.0])
        kl, top, match = [], [], []
        with torch.no_grad():
            for seq, n, ref in refs:
                lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, n - 1:n + steps].double(), -1)
                kl.append((ref.exp() * (ref - lp)).sum(-1))
                agree = ref.argmax(-1) == lp.argmax(-1)
                top.append(agree)
                bad = (~agree[:-1]).nonzero()
                match.append(int(bad[0]) if len(bad) else steps)
        c = state["count"]
        return {"kl": float(torch.cat(kl).mean()), "top1": float(torch.cat(top).float().mean()),
                "greedy": float(np.mean(match)), "macs_row": c[0] / c[1] if c[1] else None,
                "macs_rows4": c[2] / c[1] if c[1] else None}

    calibration, verify = references(CALIBRATION_PROMPTS, 16), references(VERIFY_PROMPTS, 32)
    state.update(mode="collect", amax2=[[] for _ in names])
    with torch.no_grad():
        for seq, _, _ in calibration:
            model(torch.tensor([seq]))
    energy = np.array([float(torch.cat(x).sum()) for x in state["amax2"]])
    sens = np.array([score(calibration, [None if j == i else 0 for j in range(len(names))], 16)["kl"]
                     for i in range(len(names))])
    order = np.argsort(-sens)
    for k in (int(x) for x in a.ks.split(",") if x):
        threshold = [None] * len(names)
        for i in order[:k]:
            threshold[i] = 0
        r = score(verify, threshold, 32)
        r["macs_row"] = r["macs_rows4"] = float(macs[order[:k]].sum() / macs.sum())
        print(json.dumps({"raise": "layers", "k": k, **r}), flush=True)
    for lam in (float(x) for x in a.lams.split(",") if x):
        threshold = [float(np.sqrt(lam * cols[i] * energy[i] / max(sens[i], 1e-12))) for i in range(len(names))]
        print(json.dumps({"raise": "blocks", "lam": lam, **score(verify, threshold, 32)}), flush=True)


if __name__ == "__main__":
    main()
