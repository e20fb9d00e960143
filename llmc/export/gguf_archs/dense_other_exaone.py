"""EXAONE 3.0 / 3.5 (llama.cpp's `exaone`, the converter's `ExaoneModel`) and EXAONE 4.0 (`exaone4`,
`Exaone4Model`): `TextModel`'s keys, the weights as they are (neither converter reorders q / k: llama.cpp rotates
both in halves, as transformers does), a llama3 rotary scaling written only as the `rope_freqs` divisors.

- EXAONE 3.x is transformers' Llama under `ExaoneConfig`: llama.cpp rotates whole heads (it asserts the rotated
  dims are the head size), with the q / k / v / output biases a file has. Its RMS epsilon is
  `attention.layer_norm_rms_epsilon` (llama.cpp reads no other; a converter reading the remote config's
  `layer_norm_epsilon` writes `attention.layer_norm_epsilon`, taken here as the same epsilon).
- EXAONE 4.0: norms after attention and after the MLP, q / k norms. llama.cpp slides a window only on a 64-layer
  file (32B): `attention.sliding_window` (4,096 without it) on the layers `attention.sliding_window_pattern` marks
  (the checkpoint's layer types as the converter writes them, or a period; 3 sliding then 1 full without it), the
  rotary only on the sliding layers; any other file (1.2B) attends fully everywhere, rotating every layer
  (transformers' `sliding_window=None`), whatever its window keys say.

Refused: a partial rotary on EXAONE 3.x, another rotary base on EXAONE 4.0's sliding layers (transformers' has
one), a pattern llama.cpp would not read as a period, NextN layers (EXAONE 4.5's text: no place in transformers'
EXAONE 4.0)."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _theta(g: GGUFFile) -> float:
    return float(g.keys.get("rope.freq_base", 10_000.0))  # (llama.cpp's default, not the config class's)


def _exaone_config(g: GGUFFile) -> Any:
    k = g.keys
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    whole_head_rotated(g, head)
    eps = k.get("attention.layer_norm_rms_epsilon", k.get("attention.layer_norm_epsilon"))
    biases = [f"blk.0.{n}.bias" in g.tensors for n in ("attn_q", "attn_k", "attn_v", "attn_output")]
    if any(biases) and not all(biases):
        raise UnsupportedModelError(f"{g.path}: biases on some of q / k / v / output only: transformers' EXAONE "
                                    "has all four or none")
    config = text_config(g, "exaone", head_dim=head, hidden_act="silu", attention_bias=all(biases), mlp_bias=False,
                         **({"rms_norm_eps": float(eps)} if eps is not None else {}))
    config.rope_parameters = {**config.rope_parameters, "rope_theta": _theta(g)}
    return config


def _pattern(g: GGUFFile, n: int) -> list[bool]:
    """Which layers of a 64-layer EXAONE 4.0 file slide (llama.cpp: a period, 4 without the key; the layer whose
    index + 1 is a multiple of it attends fully)."""
    key = "attention.sliding_window_pattern"
    value = g.keys.get(key, 4)
    if isinstance(value, list):
        sliding = [bool(v) for v in value]
        period = next((i + 1 for i, s in enumerate(sliding) if not s), 0)
        if len(sliding) != n or sliding != [period == 0 or (i + 1) % period != 0 for i in range(n)]:
            raise UnsupportedModelError(f"{g.path}: exaone4.{key} {value} is not a period llama.cpp reads")
        return sliding
    period = int(value)
    return [period == 0 or (i + 1) % period != 0 for i in range(n)]


def _exaone4_config(g: GGUFFile) -> Any:
    k = g.keys
    n = int(k["block_count"])
    if int(k.get("nextn_predict_layers", 0)):
        raise UnsupportedModelError(f"{g.path}: exaone4.nextn_predict_layers {k['nextn_predict_layers']}: "
                                    "transformers' EXAONE 4.0 has no NextN layers")
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    whole_head_rotated(g, head)
    window: int | None = None
    types = ["full_attention"] * n
    if n == 64:  # (llama.cpp's 32B: the only EXAONE 4.0 it slides a window on)
        window = int(k.get("attention.sliding_window", 4096))
        types = ["sliding_attention" if s else "full_attention" for s in _pattern(g, n)]
        swa_base = float(k.get("rope.freq_base_swa", _theta(g)))
        if swa_base != _theta(g):
            raise UnsupportedModelError(f"{g.path}: exaone4.rope.freq_base_swa {swa_base} beside rope.freq_base "
                                        f"{_theta(g)}: transformers' EXAONE 4.0 rotates with one base")
    config = text_config(g, "exaone4", head_dim=head, hidden_act="silu", sliding_window=window, layer_types=types)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": _theta(g)}
    return config


FAMILIES = (Family("exaone", "exaone", "EXAONE", _exaone_config),
            Family("exaone4", "exaone4", "EXAONE 4.0", _exaone4_config))
