"""What the mixture-of-experts families' GGUF files share (no family of its own): llama.cpp's converter stacks each
layer's experts per projection (`ffn_gate_exps` / `ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I] in numpy's
order; with `--fuse-gate-up-exps`, gate and up as one `ffn_gate_up_exps` [E, 2I, H]), where transformers keeps them
fused (`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]); the router is
`ffn_gate_inp` whatever the checkpoint calls it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_read import GGUFFile

FAMILIES: tuple[Any, ...] = ()  # (helpers only)

_ROUTERS = ("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.router.weight")


def layer_of(key: str) -> int | None:
    """The layer index of a transformers parameter `model.layers.{i}....` (None: not a layer's)."""
    parts = key.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdecimal():
        return int(parts[2])
    return None


def experts(key: str, g: GGUFFile) -> np.ndarray | None:
    """A layer's fused experts (`experts.gate_up_proj`: the stacked gate and up rows one after the other, or the
    fused stack as it is; `experts.down_proj`) or its router, from the file's stacks; None for another key."""
    i = layer_of(key)
    if i is None:
        return None
    blk = f"blk.{i}"
    if key.endswith("experts.gate_up_proj"):
        if f"{blk}.ffn_gate_up_exps.weight" in g.tensors:
            return g.read(f"{blk}.ffn_gate_up_exps.weight")
        gate, up = g.read(f"{blk}.ffn_gate_exps.weight"), g.read(f"{blk}.ffn_up_exps.weight")
        if gate is None or up is None:
            return None
        if gate.shape != up.shape:
            raise UnsupportedModelError(f"{g.path}: {blk}.ffn_gate_exps {list(gate.shape)} beside ffn_up_exps "
                                        f"{list(up.shape)}")
        return np.concatenate((gate, up), axis=1)
    if key.endswith("experts.down_proj"):
        return g.read(f"{blk}.ffn_down_exps.weight")
    if key.endswith(_ROUTERS):
        return g.read(f"{blk}.ffn_gate_inp.weight")
    return None


def moe_values(key: str, g: GGUFFile, bias: str | None = None) -> np.ndarray | None:
    """`experts(key, g)`, or for a layer's router score bias (the parameter ending `bias`) the file's
    `exp_probs_b.bias`; None for another key."""
    if (found := experts(key, g)) is not None:
        return found
    i = layer_of(key)
    if i is not None and bias is not None and key.endswith(bias):
        return g.read(f"blk.{i}.exp_probs_b.bias")
    return None


def bias_values(bias: str) -> Callable[[str, GGUFFile, Any], np.ndarray | None]:
    """A family's `values` reading nothing of its own but the experts, the router and the score bias `bias`
    (`moe_values`)."""
    return lambda key, g, config: moe_values(key, g, bias)


def rows(g: GGUFFile, *names: str) -> np.ndarray | None:
    """Tensors' rows one after the other (a gate and up product fused as transformers holds it)."""
    parts = [p for n in names if (p := g.read(n)) is not None]
    return np.concatenate(parts, axis=0) if len(parts) == len(names) else None


def refuse(g: GGUFFile, key: str, value: Any, why: str) -> None:
    raise UnsupportedModelError(f"{g.path}: {g.arch}.{key} {value!r}: {why}")


def has(g: GGUFFile, name: str) -> bool:
    """Whether the file holds tensor `name` in any layer (`name` without `blk.{i}.`)."""
    return any(n.split(".", 2)[-1] == name for n in g.tensors if n.startswith("blk."))


SIGMOID = 2  # (llama.cpp's expert_gating_func value)


def sigmoid_gated(g: GGUFFile, title: str, required: bool = False) -> None:
    """Refuses gating other than the sigmoid of the router's logits, transformers' `title`'s (llama.cpp's
    `expert_gating_func`; none written is read as sigmoid unless the family's loader `required` it)."""
    k = g.keys
    gating = int(k["expert_gating_func"] if required else k.get("expert_gating_func", SIGMOID) or SIGMOID)
    if gating != SIGMOID:
        refuse(g, "expert_gating_func", gating, f"transformers' {title} routes by sigmoid")


def sigmoid_renormalized(g: GGUFFile, title: str) -> None:
    """Refuses routing other than transformers' `title`'s: sigmoid gating (`sigmoid_gated`), the chosen experts'
    weights always renormalized (`expert_weights_norm`, none written: not)."""
    k = g.keys
    sigmoid_gated(g, title)
    if not bool(k.get("expert_weights_norm", False)):
        refuse(g, "expert_weights_norm", k.get("expert_weights_norm", False), f"transformers' {title} always "
               "renormalizes the chosen experts' weights")
