"""DBRX (llama.cpp's `dbrx`, the converter's `DbrxModel`): its own keys (the layers, context, width, the experts'
width as `feed_forward_length`, heads and KV heads, the rotary base, the q / k / v clamp as
`attention.clamp_kqv`, the experts' count and top-k, LayerNorm epsilon 1e-5); the fused q / k / v rows as they are
(llama.cpp rotates DBRX's halves, NeoX's way, as transformers does); the experts' flat [E x I, H] products viewed
per expert, `w1` / `v1` as the gate / up stacks [E, I, H], `w2` transposed per expert into the down stack
[E, H, I] (undone here: transformers keeps all three as [E x I, H], w2 applied untransposed).

llama.cpp clamps the fused q / k / v output, routes by softmax and renormalizes the top-k by their sum
(src/models/dbrx.cpp), as transformers' DBRX does with the checkpoints' moe_normalize_expert_weights 1 (all
positive: the 1-norm is the sum); its LayerNorms have no biases.

Refused: a tied head (transformers' DBRX has none), another LayerNorm epsilon, grouped routing."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.moe_common import layer_of, refuse
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    if "output.weight" not in g.tensors:
        raise UnsupportedModelError(f"{g.path}: a DBRX GGUF without output.weight (a tied head): transformers' DBRX "
                                    "has a head of its own")
    eps = float(k.get("attention.layer_norm_epsilon", 1e-5))
    if abs(eps - 1e-5) > 1e-12:
        refuse(g, "attention.layer_norm_epsilon", eps, "transformers' DBRX LayerNorms take 1e-5")
    if int(k.get("expert_group_count", 1) or 1) > 1:
        refuse(g, "expert_group_count", k["expert_group_count"], "transformers' DBRX routes without groups")
    clamp = k.get("attention.clamp_kqv")
    config = text_config(
        g, "dbrx", d_model=int(k["embedding_length"]), n_heads=int(k["attention.head_count"]),
        n_layers=int(k["block_count"]), max_seq_len=int(k["context_length"]), tie_word_embeddings=False,
        attn_config={"kv_n_heads": int(k.get("attention.head_count_kv", k["attention.head_count"])),
                     "clip_qkv": float(clamp) if clamp else None,  # (its rotary base: transformers' DBRX
                     "rope_theta": float(k.get("rope.freq_base", 10000.0))},  # asks the attention's config for it)
        ffn_config={"ffn_hidden_size": int(k["feed_forward_length"]), "moe_num_experts": int(k["expert_count"]),
                    "moe_top_k": int(k["expert_used_count"]), "moe_normalize_expert_weights": 1.0,
                    "ffn_act_fn": {"name": "silu"}})
    return config


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    i = layer_of(key.replace("transformer.blocks.", "model.layers.", 1))
    if i is None or ".ffn.experts.mlp." not in key:
        return None
    kind = key.rsplit(".", 1)[1]
    stack = g.read(f"blk.{i}.{ {'w1': 'ffn_gate_exps', 'v1': 'ffn_up_exps', 'w2': 'ffn_down_exps'}[kind]}.weight")
    if stack is None or stack.ndim != 3:
        return None
    if kind == "w2":  # [E, H, I] -> [E, I, H]
        stack = stack.transpose(0, 2, 1)
    return np.ascontiguousarray(stack).reshape(-1, stack.shape[-1])


FAMILIES = (Family("dbrx", "dbrx", "DBRX", _config, values=_values),)
