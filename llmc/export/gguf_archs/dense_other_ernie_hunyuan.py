"""ERNIE 4.5 dense (llama.cpp's `ernie4_5`, the converter's `Ernie4_5Model`) and Hunyuan dense (`hunyuan-dense`,
`HunYuanModel`): `TextModel`'s keys and the tensors by gguf's name table, as they are.

- ERNIE 4.5: the converter splits a fused `qkv_proj` / `up_gate_proj` (Paddle's names) into transformers' q / k / v
  and gate / up, which is where transformers' ERNIE 4.5 has them; q / k rows as they are (llama.cpp rotates
  interleaved pairs, as transformers' ERNIE 4.5 does). llama.cpp rotates whole heads and reads q / k / v biases
  only; transformers' `use_bias` puts one on every product: a file with biases is refused.
- Hunyuan dense: q / k norms after the rotary (llama.cpp's order, transformers' too), rotated in halves. Its
  NTK-alpha rotary ("dynamic" with `alpha` in the checkpoints) is written as the stretched base
  (`rope.freq_base` = base x alpha^(d / (d - 2))), which a plain rotary of that base computes; a file with
  `rope.scaling.alpha` has its base stretched so by llama.cpp, and here. llama.cpp rotates whole heads, with the
  q / k / v / output biases a file has. Refused: `rope.dimension_sections` (HunyuanVL's XD-RoPE).

Neither file names the rotary base where the checkpoint had none: llama.cpp's 10,000 stands, not the config
classes' 500,000."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _head(g: GGUFFile) -> int:
    """The head size as llama.cpp takes it, refusing a file whose rotated dims are not the whole head."""
    k = g.keys
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(k["attention.head_count"]))
    whole_head_rotated(g, head)
    return head


def _ernie_config(g: GGUFFile) -> Any:
    head = _head(g)
    biases = sorted(n for n in g.tensors if n.endswith(".bias"))
    if biases:
        raise UnsupportedModelError(f"{g.path}: {biases[0]}: transformers' ERNIE 4.5 has biases on every product "
                                    "or none, llama.cpp's on q / k / v only")
    config = text_config(g, "ernie4_5", head_dim=head, hidden_act="silu", use_bias=False)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": float(g.keys.get("rope.freq_base", 10_000.0))}
    return config


def _hunyuan_config(g: GGUFFile) -> Any:
    k = g.keys
    head = _head(g)
    if any(int(s) for s in (k.get("rope.dimension_sections") or [])):
        raise UnsupportedModelError(f"{g.path}: {g.arch}.rope.dimension_sections {k['rope.dimension_sections']}: "
                                    "HunyuanVL's XD-RoPE, which transformers' Hunyuan dense does not rotate")
    theta = float(k.get("rope.freq_base", 10_000.0))
    alpha = float(k.get("rope.scaling.alpha", 0.0))
    if alpha > 0:  # (llama.cpp's NTK-alpha: the base stretched)
        theta *= alpha ** (head / (head - 2))
    biases = [f"blk.0.{n}.bias" in g.tensors for n in ("attn_q", "attn_k", "attn_v", "attn_output")]
    if any(biases) and not all(biases):
        raise UnsupportedModelError(f"{g.path}: biases on some of q / k / v / output only: transformers' Hunyuan "
                                    "dense has all four or none")
    config = text_config(g, "hunyuan_v1_dense", head_dim=head, hidden_act="silu", attention_bias=all(biases))
    rope = {key: v for key, v in config.rope_parameters.items() if key != "alpha"}  # (stretched into the base)
    config.rope_parameters = {**rope, "rope_theta": theta}
    return config


FAMILIES = (Family("ernie4_5", "ernie4_5", "ERNIE 4.5", _ernie_config),
            Family("hunyuan-dense", "hunyuan_v1_dense", "Hunyuan dense", _hunyuan_config))
