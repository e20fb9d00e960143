"""GLM-5 / GLM-5.1 / GLM-5.2 (llama.cpp's `glm-dsa`, the converter's `GlmMoeDsaModel`) and DeepSeek-V3.2
(`deepseek32`, `DeepseekV32Model`): DeepSeek-V3's latent attention and grouped sigmoid mixture, both converters being
`DeepseekV2Model`'s (its keys, `kv_b_proj` split into `attn_k_b` / `attn_v_b`, the selection bias as `exp_probs_b`,
the experts stacked: read as moe_deepseek2 reads them), with DeepSeek Sparse Attention's lightning indexer added:
`attention.indexer.head_count` / `key_length` / `top_k` and each layer's `indexer.attn_q_b` (off the query latent),
`indexer.attn_k`, `indexer.k_norm` (a LayerNorm's weight and bias) and `indexer.proj` (the heads' weights), under
gguf's names as they are. Both count the NextN (MTP) blocks in `block_count` (`nextn_predict_layers`) and write their
tensors, which llama.cpp loads and never runs: the model is the layers before them. GLM's converter writes
`rope.dimension_count` again (x the checkpoint's partial_rotary_factor) and GLM-5.2's `attention.indexer.types`, a
boolean per layer (true: the layer runs its indexer; false: it takes the previous full layer's top-k). gguf's package
knows glm-dsa's names, not deepseek32, whose tensors follow them.

llama.cpp (src/models/glm-dsa.cpp, deepseek32.cpp) scores every earlier key per query as transformers' indexer does:
relu(q.k) per indexer head, weighted by `proj` x (heads x key length)^-1/2, summed, causally masked (a Hadamard
rotation of q and k first, which leaves the dot products as they are); the top `top_k` keys (every key of a shorter
row) are the only ones the latent attention sees. The indexer rotates its first `rope.dimension_count` dims by
pairs for GLM and by halves for DeepSeek-V3.2, as transformers' GlmMoeDsa and DeepseekV32 indexers do; the latent
attention rotates by pairs in both. Put back: the sigmoid llama.cpp's glm-dsa routes by where the file has no
`expert_gating_func` (DeepSeek-V2's reading would take softmax), the layers less the NextN blocks, and where a GLM
file has no types the pattern llama.cpp puts in: every layer full below a 2^20 context (GLM-5 / 5.1), else
GLM-5.2's (the first three layers full, then every fourth, over its 78 layers).

Not in the file, so the classes' own: the indexer key norm's epsilon (1e-6), and the latent norms' (1e-6, where
llama.cpp takes `layer_norm_rms_epsilon`: GLM-5's 1e-5, about 1e-6 relative on the latents, below bf16's
resolution, so not refused).

Refused: routing other than sigmoid (both classes route so); an indexer key length other than twice the rotated dims
(llama.cpp takes the unrotated part from offset `key_length - n_rot` where the checkpoint's is at `n_rot`: the same
only then, as in GLM-5's and V3.2's 128 of 64); types that do not give every layer one or whose first layer shares
(there is no earlier top-k: llama.cpp asserts, transformers raises); yarn's log multiplier on glm-dsa (its loader
does not read it, so llama.cpp's q.k scale leaves out the mscale_all_dim that transformers' would take)."""

from __future__ import annotations

import dataclasses
from typing import Any

from llmc.export.gguf_archs import moe_deepseek2
from llmc.export.gguf_archs.moe_common import SIGMOID, refuse, sigmoid_gated
from llmc.export.gguf_read import Family, GGUFFile, text_config

# the latent attention's, the mixture's and the rotary's fields as moe_deepseek2 reads them (DeepSeek-V3's config)
_MLA = ("num_key_value_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
        "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
        "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group", "first_k_dense_replace",
        "rope_parameters", "attention_bias")

# llama.cpp's GLM-5.2 pattern for a glm-dsa file of a 2^20 context without attention.indexer.types
# (GLM_5_2_DEFAULT_INDEXER_TYPES): transformers' index_topk_freq 4 after index_skip_topk_offset 3, over 78 layers
_GLM52_CONTEXT, _GLM52_LAYERS, _GLM52_FREQ, _GLM52_OFFSET = 1 << 20, 78, 4, 3


def _dsa_config(g: GGUFFile, model_type: str, **fields: Any) -> Any:
    """`model_type`'s config: DeepSeek-V3's reading of the file (moe_deepseek2, as sigmoid routing: the callers
    check it) with the query rank the indexer needs, the indexer's sizes and `fields`."""
    k = g.keys
    mla = moe_deepseek2.mla_config(dataclasses.replace(g, keys={**k, "expert_gating_func": SIGMOID}))
    rotated, length = int(mla.qk_rope_head_dim), int(k["attention.indexer.key_length"])
    if length != 2 * rotated:
        refuse(g, "attention.indexer.key_length", length, f"llama.cpp takes the indexer's unrotated dims from offset "
               f"{length - rotated}, the checkpoint's are at {rotated}: the same only at twice the {rotated} rotated")
    return text_config(g, model_type, num_hidden_layers=g.layers(), q_lora_rank=int(k["attention.q_lora_rank"]),
                       index_n_heads=int(k["attention.indexer.head_count"]), index_head_dim=length,
                       index_topk=int(k["attention.indexer.top_k"]), **{f: getattr(mla, f) for f in _MLA}, **fields)


def _indexer_types(g: GGUFFile, n: int) -> list[str]:
    """Each layer's indexer as llama.cpp's glm-dsa takes it: the file's types, or (none written) every layer full
    below a 2^20 context (GLM-5 / 5.1), GLM-5.2's pattern from one."""
    k = g.keys
    value = k.get("attention.indexer.types")
    if isinstance(value, list) and len(value) != n:  # (llama.cpp: an array of another length is an error)
        refuse(g, "attention.indexer.types", value, f"{len(value)} types for {n} layers")
    if value is not None:
        full = [bool(v) for v in g.per_layer("attention.indexer.types", n)]
    elif int(k["context_length"]) < _GLM52_CONTEXT:
        full = [True] * n
    else:
        full = [i < _GLM52_LAYERS and max(i - _GLM52_OFFSET + 1, 0) % _GLM52_FREQ == 0 for i in range(n)]
    if not full[0]:
        refuse(g, "attention.indexer.types", value, "its first layer takes an earlier layer's top-k: there is none")
    return ["full" if f else "shared" for f in full]


def _glm_config(g: GGUFFile) -> Any:
    k = g.keys
    sigmoid_gated(g, "GLM-MoE-DSA")  # (none written: sigmoid)
    if "rope.scaling.yarn_log_multiplier" in k:
        refuse(g, "rope.scaling.yarn_log_multiplier", k["rope.scaling.yarn_log_multiplier"], "llama.cpp's glm-dsa "
               "does not read it (its q.k scale leaves out mscale_all_dim), transformers' GLM-MoE-DSA would take it")
    return _dsa_config(g, "glm_moe_dsa", indexer_types=_indexer_types(g, g.layers()))


def _v32_config(g: GGUFFile) -> Any:
    sigmoid_gated(g, "DeepSeek-V3.2", required=True)  # (llama.cpp's deepseek32 requires the key)
    return _dsa_config(g, "deepseek_v32")


FAMILIES = (Family("glm-dsa", "glm_moe_dsa", "GLM-5 (GLM-MoE-DSA)", _glm_config, values=moe_deepseek2.mla_values,
                   rope_freqs=False),
            Family("deepseek32", "deepseek_v32", "DeepSeek-V3.2", _v32_config, values=moe_deepseek2.mla_values,
                   rope_freqs=False, table="glm-dsa"))
