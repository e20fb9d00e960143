"""OLMo 2 (llama.cpp's `olmo2`, the converter's `Olmo2Model`, a `TextModel`: no tensor reordered, llama.cpp rotating
OLMo 2's halves as transformers does): `TextModel`'s keys, RMS norms after attention and after the MLP (none
before), q / k RMS-normed over all heads at once (one [heads x head size] weight each), heads of width / heads, no
biases (llama.cpp's OLMo 2 has none: a file's would be left unread, refused).

The converter writes OLMo 3 (`Olmo3ForCausalLM`) as `olmo2` too, with a window (`attention.sliding_window`) and the
checkpoint's layer types as `attention.sliding_window_pattern`; such a file reads as transformers' OLMo 3 (`olmo3`).
What llama.cpp computes from it (src/models/olmo2.cpp and its hparams): a window where `attention.sliding_window` is
positive, on the layers of a period (`attention.sliding_window_pattern`, 4 without it: the layer whose index + 1 is a
multiple of it attends fully); the sliding layers rotate with the rotary base and no scaling at all, the full layers
with the file's scaling (yarn: the factor and original context; its magnitude 0.1 ln(factor) + 1, transformers'
yarn without an attention factor, which is OLMo 3's attention_factor).

Refused by key, where llmc cannot say what llama.cpp computes or transformers' OLMo 3 cannot compute it: a layer
pattern that is not a period of 4 (llama.cpp reads a period), `rope.freq_base_swa` other than the rotary base
(llama.cpp's graph rotates the sliding layers with the full layers' base, its cache shifts them with this one),
`rope.scaling.attn_factor` other than 1 (llama.cpp multiplies its yarn magnitude by it, which would apply OLMo 3's
attention factor twice), `rope.scaling.yarn_attn_factor` other than yarn's own magnitude (llama.cpp's OLMo 2 does
not read it), yarn betas other than 32 / 1 (llama.cpp's OLMo 2 reads none: its defaults stand), a scaling other
than none, linear and yarn, a `rope_freqs` tensor (llama.cpp's OLMo 2 has no place for it)."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import kv_heads, whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, _scaled_rope, text_config, unread_yarn


def _refuse(g: GGUFFile, key: str, why: str) -> None:
    raise UnsupportedModelError(f"{g.path}: olmo2.{key} {g.keys[key]!r}: {why}")


def _pattern(g: GGUFFile, n: int) -> list[bool]:
    """Which layers slide, as llama.cpp's OLMo 2 reads `attention.sliding_window_pattern`: a period (4 without the
    key); an array is taken where it is the period 4's, as the converter writes OLMo 3's layer types."""
    key = "attention.sliding_window_pattern"
    value = g.keys.get(key, 4)
    default = [(i + 1) % 4 != 0 for i in range(n)]
    if isinstance(value, list):
        if [bool(v) for v in value] != default:
            _refuse(g, key, "not the period of 4 llama.cpp's OLMo 2 reads")
        return default
    period = int(value)
    return [period == 0 or (i + 1) % period != 0 for i in range(n)]


def _olmo3_rope(g: GGUFFile) -> dict[str, Any]:
    """The sliding and full layers' rotary parameters (transformers' OLMo 3 takes one table per layer type)."""
    k = g.keys
    theta = float(k.get("rope.freq_base", 10_000.0))  # (llama.cpp's default where the file has none)
    if "rope.freq_base_swa" in k and float(k["rope.freq_base_swa"]) != theta:
        _refuse(g, "rope.freq_base_swa", f"llama.cpp's OLMo 2 rotates its sliding layers with rope.freq_base ({theta}) "
                "and shifts their cache with this one")
    keys = unread_yarn(g, "OLMo 2")
    full = {"rope_type": "default", "rope_theta": theta, **_scaled_rope(keys, g.tensors, g.path, g.arch)}
    return {"sliding_attention": {"rope_type": "default", "rope_theta": theta}, "full_attention": full}


def _olmo3(g: GGUFFile, window: int) -> Any:
    n = int(g.keys["block_count"])
    if "rope_freqs.weight" in g.tensors:
        raise UnsupportedModelError(f"{g.path}: rope_freqs.weight: llama.cpp's OLMo 2 has no place for it")
    types = ["sliding_attention" if s else "full_attention" for s in _pattern(g, n)]
    return text_config(g, "olmo3", num_key_value_heads=kv_heads(g), attention_bias=False, sliding_window=window,
                       layer_types=types, rope_parameters=_olmo3_rope(g))


def _olmo2(g: GGUFFile) -> Any:
    k = g.keys
    head = int(k["embedding_length"]) // int(k["attention.head_count"])
    if int(k.get("attention.key_length", head)) != head:
        raise UnsupportedModelError(f"{g.path}: olmo2.attention.key_length {k['attention.key_length']}: OLMo 2's "
                                    f"heads are width / heads ({head})")
    whole_head_rotated(g, head)
    window = int(k.get("attention.sliding_window", 0) or 0)
    if window > 0:  # (OLMo 3: llama.cpp slides a window only where the key is positive)
        return _olmo3(g, window)
    if "rope.scaling.attn_factor" in k:
        raise UnsupportedModelError(f"{g.path}: olmo2.rope.scaling.attn_factor {k['rope.scaling.attn_factor']}: "
                                    "a yarn attention factor, which llmc does not read")
    return text_config(g, "olmo2", num_key_value_heads=kv_heads(g), attention_bias=False)


FAMILIES = (Family("olmo2", "olmo2", "OLMo 2 / OLMo 3", _olmo2),)
