"""What the dense Llama-like families' readers share (no family of its own): the KV head count as llama.cpp takes
it (one value, or one per layer where the converter writes an array), the bias flags a file's tensors show, the
rotated share of a head that llama.cpp's graphs of these families require to be the whole head, and the q / k rows
of `LlamaModel`'s converters put back in order."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_read import GGUFFile, unpermute

FAMILIES: tuple[Any, ...] = ()

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
MLP = ("ffn_gate", "ffn_up", "ffn_down")


def kv_heads(g: GGUFFile) -> int | None:
    """`attention.head_count_kv`: one value, or an array of one value per layer (Granite 4.0's dense models, which
    `GraniteHybridModel` converts as `granite`); differing values are refused."""
    value = g.keys.get("attention.head_count_kv")
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.head_count_kv {value} differs between layers: "
                                        "transformers' model takes one count")
        return int(value[0])
    return None if value is None else int(value)


def bias_flag(g: GGUFFile, names: tuple[str, ...], flag: str) -> bool:
    """Whether the file's first layer has biases on `names` (transformers' one `flag` covers them all); some but not
    all is refused."""
    found = [n for n in names if f"blk.0.{n}.bias" in g.tensors]
    if found and len(found) != len(names):
        missing = ", ".join(n for n in names if n not in found)
        raise UnsupportedModelError(f"{g.path}: blk.0.{found[0]}.bias without {missing} biases: transformers' {flag} "
                                    "puts biases on all of them or none")
    return bool(found)


def whole_head_rotated(g: GGUFFile, head: int) -> None:
    """Refuses `rope.dimension_count` other than the head size (llama.cpp's graphs of these families assert it, or
    transformers' rotary of the family has no partial rotation)."""
    rotated = g.keys.get("rope.dimension_count")
    if rotated is not None and int(rotated) != head:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.rope.dimension_count {rotated} for heads of {head}: the "
                                    "family rotates the whole head")


def unpermuted_qk(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    """The q / k product's rows (and biases) of a file of a `LlamaModel` converter, which reorders them for
    llama.cpp's rotary (`LlamaModel.permute`: by the query heads, the keys by the KV heads) back in transformers'
    order; None for every other parameter."""
    if key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        heads = int(config.num_attention_heads)
    elif key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        heads = int(config.num_key_value_heads)
    else:
        return None
    rows = g.named(key)
    return None if rows is None else unpermute(rows, heads)
