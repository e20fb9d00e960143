"""What the mixture-of-experts families' GGUF writers share (tests of their own in test_gguf_archs_moe_*.py):
`TextModel.set_gguf_parameters` as llama.cpp's converter runs it on the checkpoint's config (`text_keys`), and a
tiny model's tensors written under gguf's names with each family's transforms (`write_moe`), the experts stacked
per projection as the converter stacks them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from gguf_files import _finish, _tokenizer

Tensors = Iterable[tuple[str, np.ndarray]]


def _find(h: dict[str, Any], *names: str) -> Any:
    return next((h[n] for n in names if h.get(n) is not None), None)


def text_keys(w: Any, h: dict[str, Any]) -> None:
    """`TextModel.set_gguf_parameters` on the checkpoint's config `h` (its `to_dict()`, as the converter loads it)."""
    import gguf

    w.add_block_count(h["num_hidden_layers"])
    for add, names in ((w.add_context_length, ("max_position_embeddings", "n_ctx", "n_positions")),
                       (w.add_embedding_length, ("hidden_size", "n_embd", "dim")),
                       (w.add_feed_forward_length, ("intermediate_size", "n_inner", "hidden_dim")),
                       (w.add_head_count, ("num_attention_heads", "n_head", "n_heads")),
                       (w.add_head_count_kv, ("num_key_value_heads", "n_kv_heads"))):
        if (value := _find(h, *names)) is not None:
            add(value)
    rope = dict(h.get("rope_parameters") or {})
    kind = rope.get("rope_type")
    if kind == "yarn" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                         ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
        if (attn := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(attn)
    elif kind == "linear" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])
    if (eps := _find(h, "rms_norm_eps", "norm_eps")) is not None:
        w.add_layer_norm_rms_eps(eps)
    if (eps := _find(h, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")) is not None:
        w.add_layer_norm_eps(eps)
    if (n := _find(h, "num_local_experts", "num_experts")) is not None:
        w.add_expert_count(n)
    if (n := _find(h, "num_experts_per_tok", "num_experts_per_token", "top_k_experts")) is not None:
        w.add_expert_used_count(n)
    if h.get("n_group") is not None:
        w.add_expert_group_count(h["n_group"])
    if h.get("topk_group") is not None:
        w.add_expert_group_used_count(h["topk_group"])
    if (score := _find(h, "score_function", "scoring_func", "score_func", "moe_router_activation",
                       "moe_router_activation_func")) is not None:
        w.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                  "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[score])
    if h.get("head_dim") is not None:
        w.add_key_length(h["head_dim"])
        w.add_value_length(h["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def split_experts(name: str, values: np.ndarray) -> Tensors:
    """transformers' fused experts as the converter writes the checkpoint's per-expert products: stacked per
    projection, [E, I, H] gate and up, [E, H, I] down."""
    blk = f"blk.{name.split('.')[2]}"
    if name.endswith("experts.gate_up_proj"):
        half = values.shape[1] // 2
        return [(f"{blk}.ffn_gate_exps.weight", values[:, :half]), (f"{blk}.ffn_up_exps.weight", values[:, half:])]
    return [(f"{blk}.ffn_down_exps.weight", values)]


def write_moe(model: Any, folder: Path, out: Path, arch: str, keys: Callable[[Any, dict[str, Any]], None],
              transform: Callable[[str, np.ndarray], Tensors | None] | None = None, skip: tuple[str, ...] = (),
              metadata: dict[str, Any] | None = None, leave_out: tuple[str, ...] = (), table: str = "") -> Path:
    """A tiny model as its family's converter writes it: `keys(writer, hparams)` its metadata, the tokenizer, each
    tensor through `transform(name, values)` (None: under gguf's name as it is, by `table`'s name table where
    gguf's package has none for `arch`), the experts stacked; `skip` names left out (a tied head)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{c.model_type}")
    keys(w, c.to_dict())
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == (table or arch)),
                                     c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name in skip or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        values = tensor.detach().float().numpy()
        written = transform(name, values) if transform else None
        if written is None and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            written = split_experts(name, values)
        if written is None:
            mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                raise ValueError(f"gguf has no name for {name}")
            written = [(mapped, values)]
        for mapped, array in written:
            if mapped not in leave_out:
                w.add_tensor(mapped, np.ascontiguousarray(array, dtype=np.float32))
    _finish(w, leave_out, metadata)
    return out
