"""Apertus (llama.cpp's `apertus`, the converter's `ApertusModel`, a `LlamaModel` with `undo_permute = False`: q / k
rows as the checkpoint has them): `LlamaModel`'s keys, llama3 rotary scaling as the `rope_freqs` divisors (the
checkpoints' llama3, θ 12M), per-head q / k RMS norms, an MLP of up / down with the xIELU activation (no key says
so: llama.cpp's Apertus graph fixes it) whose four per-layer values the converter moves out of the tensors into
metadata arrays (`xielu.alpha_p`, `xielu.alpha_n`, `xielu.beta`, `xielu.eps`, keys without the architecture's prefix:
each layer's raw parameter, llama.cpp applying the softplus as transformers does), read back here into each layer's
`act_fn`."""

from __future__ import annotations

from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import ATTENTION, bias_flag, kv_heads, whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, _scaled_rope, text_config

_XIELU = ("alpha_p", "alpha_n", "beta", "eps")


def _xielu(g: GGUFFile, name: str) -> list[float]:
    """A per-layer xIELU value (llama.cpp takes one for all layers or an array of one per layer)."""
    n = int(g.keys["block_count"])
    field = g.reader.fields.get(f"xielu.{name}")
    if field is None:
        raise UnsupportedModelError(f"{g.path}: an Apertus GGUF without xielu.{name} (each layer's xIELU): "
                                    "llama.cpp's converter writes it")
    values = [float(field.parts[i][0]) for i in field.data]
    values = values * n if len(values) == 1 else values
    if len(values) != n:
        raise UnsupportedModelError(f"{g.path}: xielu.{name} has {len(values)} values for {n} layers")
    return [float(v) for v in values]


def _apertus(g: GGUFFile) -> Any:
    k = g.keys
    for name in _XIELU:
        _xielu(g, name)  # (each there, one per layer: else refused before the model is built)
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    whole_head_rotated(g, head)
    rope = {"rope_type": "default", "rope_theta": float(k.get("rope.freq_base", 12_000_000.0))}  # (the class's
    rope.update(_scaled_rope(k, g.tensors, g.path, g.arch))  # default is llama3: its divisors are `rope_freqs`)
    return text_config(g, "apertus", head_dim=head, num_key_value_heads=kv_heads(g), hidden_act="xielu",
                       attention_bias=bias_flag(g, ATTENTION, "attention_bias"), rope_parameters=rope)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    parts = key.split(".")
    if len(parts) == 6 and parts[1] == "layers" and parts[3:5] == ["mlp", "act_fn"] and parts[5] in _XIELU:
        value = _xielu(g, parts[5])[int(parts[2])]
        return np.array([value] if parts[5] in ("alpha_p", "alpha_n") else value, dtype=np.float32)
    return None


FAMILIES = (Family("apertus", "apertus", "Apertus", _apertus, values=_values),)
