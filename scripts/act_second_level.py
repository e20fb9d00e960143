"""Where the 4-bit product's second int8 level of x pays: whole layers (how `--quality-target` raises today) against
finer choices of where it goes, simulated in transformers.

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

Static choices, the same for every row (so a batch's rows never disagree), ranked by a predicted KL from the
Fisher information of sampled tokens on the calibration prompts; the head keeps two levels (at batch 8 it waits on
its bytes either way) and the MAC shares (`macs_layers`) are of the 120 layer products:

4. `--column-fracs F,..`: output tiles of 16 columns (the VNNI kernel's unit) at two levels, ranked by
   1/2 sum_t F_n err_n^2 per multiply-add; with `--pairs`, (output tile, input block) pairs instead.
5. `--lowrank-fracs F,..`: one level everywhere plus a low-rank correction of its error from the second level,
   y = W x1 + (W D V)(V^T D^-1 r2), V the top eigenvectors of D F D for the product's input (lowrank()).

    python scripts/act_second_level.py --column-fracs 0,0.1,0.2,0.3,0.4,0.5,1 --samples 4
    python scripts/act_second_level.py --column-fracs 0.1,0.2,0.3,0.4 --pairs --samples 4
    python scripts/act_second_level.py --lowrank-fracs 0,0.03,0.1,0.25 --samples 4
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
    p.add_argument("--column-fracs", default="", help="shares of the layers' MACs (the head apart) whose output "
                   "tiles take the second level, chosen by predicted KL per multiply-add (e.g. 0.1,0.2,0.3)")
    p.add_argument("--pairs", action="store_true", help="--column-fracs over (output tile, input block) pairs")
    p.add_argument("--lowrank-fracs", default="", help="one level everywhere plus a low-rank correction of its "
                   "error, ranks allocated by predicted KL per multiply-add up to these shares of the layers' MACs")
    p.add_argument("--samples", type=int, default=8, help="sampled tokens a position for the Fisher estimate")
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

    def quantize(x: torch.Tensor, name: str) -> torch.Tensor:
        mode, g = state["mode"], index[product(name)]
        if mode in ("fp", "cols", "fisher", "lr"):
            return x
        if mode == "lrfisher":
            if name in first and not name.endswith("lm_head"):
                x.retain_grad()
                blocks = x.detach().reshape(-1, x.shape[-1] // 32, 32)
                state["kept"][product(name)] = (x, ((blocks - level(blocks)) ** 2).reshape(-1, x.shape[-1]))
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

    def by_columns(mod: torch.nn.Linear, args: tuple, out: torch.Tensor, name: str) -> torch.Tensor | None:
        """`cols`: the output tiles in state["tiles"][name] (or tile-block pairs) from two levels of x, the rest
        from one. `fisher`: keeps the output (its gradient) and the one-level error of each output column (or each
        input block's share of it). `lr`: lowrank()'s product."""
        if state["mode"] == "lr":
            return state["lr_forward"](mod, args[0], name)
        if state["mode"] not in ("cols", "fisher"):
            return None
        x = args[0]
        blocks = x.reshape(-1, x.shape[-1] // 32, 32)
        one = level(blocks)
        if state["mode"] == "fisher":
            if name.endswith("lm_head"):  # (always at two levels)
                return None
            out.retain_grad()
            if state["pairs"]:  # the error each input block brings each output column: [T, N, blocks]
                w = mod.weight.reshape(mod.out_features, -1, 32)
                err = torch.einsum("tbk,nbk->tnb", (blocks - one).detach(), w.detach())
            else:
                err = torch.nn.functional.linear((blocks - one).reshape(x.shape), mod.weight)
            state["kept"][name] = (out, err.detach())
            return None
        second = level(blocks - one)
        y1 = torch.nn.functional.linear(one.reshape(x.shape), mod.weight, mod.bias)
        chosen = state["tiles"][name]
        if chosen.dim() == 2:  # [tiles, blocks]: the second level's product on the chosen pairs only
            w = mod.weight.reshape(mod.out_features, -1, 32)
            per_block = torch.einsum("tbk,nbk->tnb", second, w)
            mask = chosen.repeat_interleave(16, 0).to(per_block.dtype)
            return y1 + (per_block * mask).sum(-1).reshape(y1.shape)
        y2 = torch.nn.functional.linear((one + second).reshape(x.shape), mod.weight, mod.bias)
        return torch.where(chosen.repeat_interleave(16), y2, y1)

    for n, m in linear.items():
        m.register_forward_hook(lambda mod, args, out, n=n: by_columns(mod, args, out, n))

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

    def score(refs: list, threshold: list | None, steps: int, mode: str = "q") -> dict:
        state.update(mode=mode, threshold=threshold, count=[0.0, 0.0, 0.0])
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
    if a.lowrank_fracs:
        lowrank(model, linear, product, first, calibration, verify, state, score,
                [float(f) for f in a.lowrank_fracs.split(",")], a.samples)
        return
    if a.column_fracs:
        columns(model, linear, calibration, verify, state, score, [float(f) for f in a.column_fracs.split(",")],
                a.samples, a.pairs)
        return
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


def level(x):
    """One int8 level of x [.., blocks, 32] as MatMulQ4 takes it: round(x / s) s, s = max |x| / 127 per block."""
    import torch

    s = x.abs().amax(-1, keepdim=True) / 127
    return torch.round(x / torch.where(s == 0, torch.ones_like(s), s)) * s


def sampled_gradients(model, calibration: list, samples: int, state: dict, mode: str):
    """For each calibration sequence, `samples` times: a token drawn from the model at each scored position, and the
    gradient of their summed log-probability taken back through the model in `mode` (whose hooks keep what they
    need in state["kept"]). Yields (draw, state["kept"]) after each backward pass; the draws are seeded."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for seq, n, _ in calibration:
        for draw in range(samples):
            state.update(mode=mode, kept={})
            logits = model(torch.tensor([seq])).logits[0, n - 1:len(seq) - 1]
            lp = torch.log_softmax(logits.double(), -1)
            y = torch.multinomial(lp.exp(), 1, generator=gen)
            model.zero_grad(set_to_none=True)
            lp.gather(1, y).sum().backward()
            yield draw, state["kept"]


def lowrank(model, linear: dict, product, first: set, calibration: list, verify: list, state: dict, score,
            fracs: list[float], samples: int) -> None:
    """One int8 level of x everywhere, and for each product a rank-R correction of that level's error r = x - x1:
    y = W x1 + (W D V) (V^T D^-1 r2), where r2 is the second level (what the kernel has), D^2 the mean r^2 of each
    input channel on the calibration prompts and V the top R eigenvectors of D F D, F the Fisher information of the
    product's input (E[g g^T] of the gradient of the log-probability of sampled tokens with respect to x, summed over
    the products sharing x): under independence of g and r, the predicted KL left is half the sum of the eigenvalues
    past R. Ranks are allocated over all products by eigenvalue per multiply-add (K + N a rank a row) until the
    share of the layers' MACs in `fracs`; the head keeps two levels."""
    import torch

    prods = sorted({product(n) for n in linear if not n.endswith("lm_head")})
    K = {product(n): m.in_features for n, m in linear.items()}
    N = {p: sum(m.out_features for n, m in linear.items() if product(n) == p) for p in prods}
    fisher = {p: torch.zeros(K[p], K[p], dtype=torch.float64) for p in prods}
    r2 = {p: torch.zeros(K[p], dtype=torch.float64) for p in prods}
    count = {p: 0 for p in prods}
    for si, kept in sampled_gradients(model, calibration, samples, state, "lrfisher"):
        for p, (x, e2) in kept.items():
            g = x.grad.reshape(-1, K[p]).double()
            fisher[p] += g.T @ g / samples
            if si == 0:
                r2[p] += e2.double().sum(0)
                count[p] += e2.shape[0]
    state["mode"] = "fp"
    eig = {}
    for p in prods:
        d = (r2[p] / count[p]).sqrt()
        lam, vec = torch.linalg.eigh(d[:, None] * fisher[p] * d[None, :])
        eig[p] = (lam.flip(0).clamp(min=0), vec.flip(1), d)
    units = sorted(((float(eig[p][0][i]) / (K[p] + N[p]), p) for p in prods for i in range(K[p])), key=lambda u: -u[0])
    layer_macs = sum(K[p] * N[p] for p in prods)
    total_kl = sum(float(eig[p][0].sum()) for p in prods)
    for f in fracs:
        rank, spent, kept = {p: 0 for p in prods}, 0.0, 0.0
        for v, p in units:
            if spent + K[p] + N[p] > f * layer_macs:
                break
            rank[p] += 1
            spent += K[p] + N[p]
            kept += v * (K[p] + N[p])
        proj = {}
        for p in prods:
            lam, vec, d = eig[p]
            v = vec[:, :rank[p]].float()
            proj[p] = (v.T / d.float().clamp(min=1e-12)[None, :], d.float()[:, None] * v)  # P [R, K], D V [K, R]

        def forward(mod, x, name, proj=proj):
            blocks = x.reshape(-1, x.shape[-1] // 32, 32)
            one = level(blocks)
            second = level(blocks - one).reshape(x.shape)
            y = torch.nn.functional.linear(one.reshape(x.shape), mod.weight, mod.bias)
            if name.endswith("lm_head"):
                return y + torch.nn.functional.linear(second, mod.weight)
            P, DV = proj[product(name)]
            if P.shape[0] == 0:
                return y
            return y + (second @ P.T) @ (mod.weight @ DV).T

        state["lr_forward"] = forward
        r = score(verify, None, 32, mode="lr")
        r["calibration_kl"] = score(calibration, None, 16, mode="lr")["kl"]
        ranks = np.array([rank[p] for p in prods])
        r.update(macs_layers=spent / layer_macs, predicted_kl_share=kept / total_kl,
                 extra_bytes_int8=float(sum(rank[p] * (K[p] + N[p]) for p in prods)),
                 ranks_mean=float(ranks.mean()), ranks_max=int(ranks.max()))
        print(json.dumps({"raise": "lowrank", "frac": f, **r}), flush=True)


def columns(model, linear: dict, calibration: list, verify: list, state: dict, score, fracs: list[float],
            samples: int, pairs: bool) -> None:
    """Each output tile (16 columns, the VNNI kernel's unit) gets a predicted KL for leaving it at one level of x:
    1/2 sum over positions of F_n err_n^2, with F_n the Fisher information of output n (the squared gradient of the
    log-probability of tokens sampled from the model at the scored positions, averaged over `samples` draws) and
    err_n that position's error of the one-level product. Tiles are raised in order of that per multiply-add until
    the layers' share in `fracs` (the head always at two levels: at batch 8 it waits on its bytes either way)."""
    import torch

    head = [n for n in linear if n.endswith("lm_head")]
    state["pairs"] = pairs
    score_n = {n: torch.zeros((m.out_features, m.in_features // 32) if pairs else m.out_features,
                              dtype=torch.float64) for n, m in linear.items()}
    for _, kept in sampled_gradients(model, calibration, samples, state, "fisher"):
        for name, (out, err) in kept.items():
            g = out.grad.reshape(-1, out.shape[-1]).double()
            e = err.double() if pairs else err.reshape(g.shape).double()
            w = g ** 2 if not pairs else (g ** 2)[..., None]
            score_n[name] += 0.5 * (w * e ** 2).sum(0) / samples
    state["mode"] = "fp"
    tiles = []  # (predicted KL per MAC, name, tile, MACs)
    for name, m in linear.items():
        if name in head:
            continue
        if pairs:
            t = score_n[name].reshape(-1, 16, m.in_features // 32).sum(1)  # [tiles, blocks]
            cost = 16 * 32
            tiles += [(float(v) / cost, name, (i, b), cost) for (i, b), v in np.ndenumerate(t.numpy())]
        else:
            t = score_n[name].reshape(-1, 16).sum(1)
            cost = 16 * m.in_features
            tiles += [(float(v) / cost, name, i, cost) for i, v in enumerate(t)]
    tiles.sort(key=lambda r: -r[0])
    total = sum(r[3] for r in tiles)
    share = np.cumsum([r[3] for r in tiles]) / total
    kl_share = np.cumsum([r[0] * r[3] for r in tiles]) / sum(r[0] * r[3] for r in tiles)
    for f in fracs:
        k = int(np.searchsorted(share, f))
        chosen = {n: torch.zeros((m.out_features // 16, m.in_features // 32) if pairs and n not in head
                                 else m.out_features // 16, dtype=torch.bool) for n, m in linear.items()}
        for n in head:
            chosen[n][:] = True
        for _, n, i, _ in tiles[:k]:
            chosen[n][i] = True
        state["tiles"] = chosen
        r = score(verify, None, 32, mode="cols")
        r.update(macs_layers=float(share[k - 1]) if k else 0.0, predicted_kl_share=float(kl_share[k - 1]) if k else 0.0)
        print(json.dumps({"raise": "columns", "frac": f, **r}), flush=True)


if __name__ == "__main__":
    main()
