"""StarCoder 1 / SantaCoder (llama.cpp's `starcoder`, the converter's `StarCoderModel`, transformers' gpt_bigcode):
its own keys only (the context, the width, 4 x the width as the MLP's, layers, heads, one KV head, the LayerNorm
epsilon); every weight as the checkpoint has it, by gguf's name table (the fused multi-query `c_attn` rows are the
queries, the key, the value in llama.cpp's order too; the learned positions as `position_embd`); the head tied
where the file has no `output.weight`. The activation is the tanh GELU llama.cpp computes."""

from __future__ import annotations

from typing import Any

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_read import Family, GGUFFile, text_config


def _config(g: GGUFFile) -> Any:
    k = g.keys
    heads = int(k["attention.head_count"])
    kv = int(k.get("attention.head_count_kv", heads))
    if kv != 1:  # (the converter writes 1; llama.cpp's StarCoder takes the fused rows as multi-query then)
        raise UnsupportedModelError(f"{g.path}: starcoder.attention.head_count_kv {kv}: StarCoder is multi-query "
                                    "(one KV head)")
    for key in ("rope.dimension_count", "rope.freq_base"):
        if key in k:
            raise UnsupportedModelError(f"{g.path}: starcoder.{key}: StarCoder has learned positions, no rotary")
    return text_config(g, "gpt_bigcode", multi_query=True, n_inner=int(k["feed_forward_length"]),
                       layer_norm_epsilon=float(k["attention.layer_norm_epsilon"]),
                       activation_function="gelu_pytorch_tanh")


FAMILIES = (Family("starcoder", "gpt_bigcode", "StarCoder", _config, rope_freqs=False),)
