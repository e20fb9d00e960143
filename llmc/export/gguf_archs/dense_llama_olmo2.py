"""OLMo 2 (llama.cpp's `olmo2`, the converter's `Olmo2Model`, a `TextModel`: no tensor reordered, llama.cpp rotating
OLMo 2's halves as transformers does): `TextModel`'s keys, RMS norms after attention and after the MLP (none
before), q / k RMS-normed over all heads at once (one [heads x head size] weight each), heads of width / heads, no
biases (llama.cpp's OLMo 2 has none: a file's would be left unread, refused).

The converter writes OLMo 3 (`Olmo3ForCausalLM`) as `olmo2` too, with a window (`attention.sliding_window`, its
sliding layers by `attention.sliding_window_pattern`, rotated without the full layers' yarn) and yarn's attention
factor; transformers' OLMo 2 has neither: such files are refused (llmc reads OLMo 3 from its checkpoint, `olmo3`)."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.dense_llama_common import kv_heads, whole_head_rotated
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _olmo2(g: GGUFFile) -> Any:
    k = g.keys
    if int(k.get("attention.sliding_window", 0) or 0) > 0:
        raise UnsupportedModelError(f"{g.path}: olmo2.attention.sliding_window {k['attention.sliding_window']}: "
                                    "OLMo 3's sliding layers, which transformers' OLMo 2 has not")
    if "rope.scaling.attn_factor" in k:
        raise UnsupportedModelError(f"{g.path}: olmo2.rope.scaling.attn_factor {k['rope.scaling.attn_factor']}: "
                                    "OLMo 3's yarn attention factor, which llmc does not read")
    head = int(k["embedding_length"]) // int(k["attention.head_count"])
    if int(k.get("attention.key_length", head)) != head:
        raise UnsupportedModelError(f"{g.path}: olmo2.attention.key_length {k['attention.key_length']}: OLMo 2's "
                                    f"heads are width / heads ({head})")
    whole_head_rotated(g, head)
    return text_config(g, "olmo2", num_key_value_heads=kv_heads(g), attention_bias=False)


FAMILIES = (Family("olmo2", "olmo2", "OLMo 2", _olmo2),)
