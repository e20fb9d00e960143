"""Nemotron-H (Nemotron-H 8B / 47B, Nemotron Nano 2) and its mixture form (Nemotron 3 Nano / Super), read as
llama.cpp's converter writes them (`NemotronHModel`, a `GraniteHybridModel`, in its conversion/nemotron.py and
granite.py; `nemotron_h`, or `nemotron_h_moe` where the checkpoint has experts):

- **The layer pattern** (`hybrid_override_pattern` / `layers_block_type`) is in no key of its own: llama.cpp reads
  it from the per-layer arrays `attention.head_count_kv` (the KV heads on an attention layer, 0 elsewhere) and
  `feed_forward_length` (the MLP's width, or the experts', on an MLP / mixture layer, 0 elsewhere); a layer with
  neither is a Mamba-2 layer (`llama_model_nemotron_h::load_arch_hparams`). A feed-forward layer with a router
  (`ffn_gate_inp`) is a mixture, one without a plain MLP (llama.cpp's `build_ffn_layer`).
- No positions at all (llama.cpp's rope type NONE; transformers' Nemotron-H rotates nothing): the context is written
  as 2**20; the attention's scale is 1 / sqrt(head size) (`attention.key_length`: Granite's converter drops
  `head_dim`, Nemotron-H's writes it back), which transformers fixes: an `attention.scale` of another value is refused.
- The norms' epsilon is `attention.layer_norm_rms_epsilon` (what llama.cpp reads; the checkpoints' `rms_norm_eps`
  and `layer_norm_epsilon` are one value). The MLPs are squared-ReLU without a gate, the mixer's activation SiLU.
- Tensors: the Mamba-2 mixer's in Mamba-2's layouts (`ssm_mamba2.mixer_values`); q / k rows permuted as
  `LlamaModel` does (`undo_permute`: meaningless without rotary, but the rows are the file's); each layer's experts
  stacked per projection (`ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I]: transformers' own layout), the
  router's correction bias as `exp_probs_b.bias`, the latent projections as `ffn_latent_down` / `ffn_latent_up`.
- The mixture's routing from `expert_count`, `expert_used_count`, `expert_weights_norm` (absent: no
  renormalisation, as llama.cpp), `expert_weights_scale`, `expert_group_count` / `expert_group_used_count`; sigmoid
  scores are both llama.cpp's and transformers' only kind.
- The multi-token-prediction head the converter appends as the last `nextn_predict_layers` blocks is left out:
  transformers' Nemotron-H has none (it ignores a checkpoint's `mtp.*`), and the model's logits do not use it.

The vocabulary is the embeddings' rows (the converter pads the token list to a multiple of 8, not the tensors)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from llmc.errors import UnsupportedModelError
from llmc.export.gguf_archs.ssm_mamba2 import mixer_fields, mixer_values, vocab_rows
from llmc.export.gguf_read import Family, GGUFFile, text_config, unpermute

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _one(g: GGUFFile, key: str, values: list[int], what: str) -> int | None:
    found = sorted(set(values))
    if len(found) > 1:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.{key} {found} on its {what} layers: transformers' "
                                    "Nemotron-H takes one value for them")
    return found[0] if found else None


def _layer_types(g: GGUFFile, n: int, kv: list[int], ff: list[int]) -> list[str]:
    """transformers' `layers_block_type` as llama.cpp tells the layers apart."""
    types = []
    for i in range(n):
        if kv[i] and ff[i]:
            raise UnsupportedModelError(f"{g.path}: layer {i} has both KV heads ({g.arch}.attention.head_count_kv "
                                        f"{kv[i]}) and a feed-forward width ({ff[i]}): a Nemotron-H layer is one of "
                                        "Mamba-2, attention, MLP or mixture")
        if kv[i]:
            types.append("full_attention")
        elif ff[i]:
            types.append("moe" if f"blk.{i}.ffn_gate_inp.weight" in g.tensors else "mlp")
        else:
            types.append("linear_attention")  # (Mamba-2: transformers' name for it)
    return types


def _config(g: GGUFFile) -> Any:
    k = g.keys
    n = g.layers()
    kv, ff = g.per_layer("attention.head_count_kv", n), g.per_layer("feed_forward_length", n)
    types = _layer_types(g, n, kv, ff)
    where = {t: [i for i in range(n) if types[i] == t] for t in ("full_attention", "mlp", "moe")}
    all_heads = g.per_layer("attention.head_count", n)
    heads = _one(g, "attention.head_count", [all_heads[i] for i in where["full_attention"]], "attention") or \
        all_heads[0]
    kv_heads = _one(g, "attention.head_count_kv", [kv[i] for i in where["full_attention"]], "attention") or heads
    head = int(k.get("attention.key_length") or int(k["embedding_length"]) // int(heads))
    if int(k.get("attention.value_length", head)) != head:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.value_length {k['attention.value_length']} "
                                    f"beside key_length {head}: transformers' Nemotron-H has one head size")
    scale = k.get("attention.scale")
    if scale and not math.isclose(float(scale), head ** -0.5, rel_tol=1e-6):
        raise UnsupportedModelError(f"{g.path}: {g.arch}.attention.scale {scale}: transformers' Nemotron-H scales "
                                    f"by 1 / sqrt(head size {head})")
    m = mixer_fields(g)
    t = g.tensors
    fields: dict[str, Any] = dict(
        vocab_size=vocab_rows(g), num_hidden_layers=n, layers_block_type=types, num_attention_heads=int(heads),
        num_key_value_heads=int(kv_heads), head_dim=head,
        intermediate_size=_one(g, "feed_forward_length", [ff[i] for i in where["mlp"]], "MLP") or 0,
        layer_norm_epsilon=float(k["attention.layer_norm_rms_epsilon"]), mlp_hidden_act="relu2",
        mamba_hidden_act="silu", mamba_num_heads=m["heads"], mamba_head_dim=m["head_dim"], n_groups=m["groups"],
        ssm_state_size=m["state"], conv_kernel=m["conv"],
        use_conv_bias=any(n_.endswith("ssm_conv1d.bias") for n_ in t),
        use_bias=any(n_.endswith(("ssm_in.bias", "ssm_out.bias")) for n_ in t),
        mlp_bias=any(n_.endswith(("ffn_up.bias", "ffn_down.bias")) for n_ in t),
        num_nextn_predict_layers=0)
    if where["moe"]:
        first = where["moe"][0]
        shared = t.get(f"blk.{first}.ffn_up_shexp.weight")
        latent = t.get(f"blk.{first}.ffn_latent_down.weight")
        groups = int(k.get("expert_group_count", 1) or 1)
        fields.update(
            n_routed_experts=int(k["expert_count"]), num_experts_per_tok=int(k["expert_used_count"]),
            moe_intermediate_size=int(t[f"blk.{first}.ffn_up_exps.weight"].shape[1]),  # ([H or latent, I, E])
            moe_shared_expert_intermediate_size=int(shared.shape[-1]) if shared is not None else int(
                k["expert_shared_feed_forward_length"]),
            moe_latent_size=int(latent.shape[-1]) if latent is not None else None,
            norm_topk_prob=bool(k.get("expert_weights_norm", False)),
            routed_scaling_factor=float(k["expert_weights_scale"]), n_group=groups,
            topk_group=int(k.get("expert_group_used_count", groups) or groups))
    return text_config(g, "nemotron_h", **fields)


def _values(key: str, g: GGUFFile, config: Any) -> np.ndarray | None:
    m = _LAYER.fullmatch(key)
    if m is None:
        return None  # (embeddings, final norm, head: gguf's table)
    if (values := mixer_values(key, g)) is not None:
        return values
    blk, tail = f"blk.{m[1]}", m[2]
    if tail in ("mixer.q_proj.weight", "mixer.k_proj.weight"):  # (LlamaModel.permute, undo_permute = True)
        q = tail.startswith("mixer.q")
        rows = g.read(f"{blk}.attn_{'q' if q else 'k'}.weight")
        heads = config.num_attention_heads if q else config.num_key_value_heads
        return None if rows is None else unpermute(rows, int(heads))
    if tail == "mixer.experts.up_proj":  # ([E, I, H]: transformers' layout)
        return g.read(f"{blk}.ffn_up_exps.weight")
    if tail == "mixer.experts.down_proj":
        return g.read(f"{blk}.ffn_down_exps.weight")
    if tail == "mixer.gate.e_score_correction_bias":
        return g.read(f"{blk}.exp_probs_b.bias")
    # (the checkpoint's names, which gguf's table knows: backbone.layers.N.mixer.*)
    return g.read(g.names.get_name(f"backbone.layers.{m[1]}.{tail}", try_suffixes=(".weight", ".bias")))


FAMILIES = (
    Family("nemotron_h", "nemotron_h", "Nemotron-H", _config, values=_values, rope_freqs=False),
    Family("nemotron_h_moe", "nemotron_h", "Nemotron-H MoE", _config, values=_values, rope_freqs=False),
)
