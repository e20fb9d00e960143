"""BitNet b1.58 GGUF files (llmc/export/gguf_archs/dense_other_bitnet.py) written as llama.cpp's `BitnetModel` writes
them, read back to the logits of the model the file holds: the checkpoint with its products rounded to ternary
values times their scale, as the converter rounds them (and llama.cpp computes with them)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, _finish, _tokenizer, built, read_back

from llmc.errors import UnsupportedModelError

PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight_quant(weight: Any) -> Any:
    """The converter's `BitnetModel.weight_quant`: w / s rounded to -1, 0, 1, times s (s = mean |w|, at least 1e-5)."""
    weight = weight.float()
    iscale = 1 / weight.abs().mean().clamp(min=1e-5)
    return (weight * iscale).round().clamp(-1, 1) / iscale


def rounded(model: Any, half_scales: bool = False) -> Any:
    """A copy of `model` with its products as the converter writes them: the model a BitNet file holds
    (`half_scales`: each scale rounded to fp16, as TQ1_0 / TQ2_0 blocks hold it)."""
    import torch

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name.endswith(tuple(f"{n}.weight" for n in PRODUCTS)):
                values = weight_quant(p.detach())
                if half_scales:
                    scale = values.abs().max()
                    values = values / scale * scale.half().float()
                p.copy_(values)
    return out.eval()


def write_bitnet(model: Any, folder: Path, out: Path, activation: str | None = None, scales: bool = False,
                 head: bool = False, ternary: Any = None) -> Path:
    """As `BitnetModel` writes it: `TextModel`'s keys, a linear rotary scaling of 1; each product rounded
    (`weight_quant`), the sub-norms under gguf's names, no lm_head. `activation`: a `hidden_activation` key (which
    llama.cpp reads; the converter writes none); `scales`: the products as their ternary values with each scale as
    a `.scale` tensor (the other form llama.cpp reads); `head`: an `output.weight` (no BitNet file has one);
    `ternary`: the products packed in this type (the converter's --outtype tq1_0 / tq2_0)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(out), "bitnet")
    for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_file_type, gguf.LlamaFileType.ALL_F32),
                       (w.add_rope_scaling_type, gguf.RopeScalingType.LINEAR), (w.add_rope_scaling_factor, 1.0)):
        add(value)
    if activation is not None:
        w.add_string("bitnet.hidden_activation", activation)
    _tokenizer(w, folder, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BITNET, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        values = tensor.detach().float()
        if name == "lm_head.weight":
            if head:
                w.add_tensor("output.weight", np.ascontiguousarray(values.numpy()))
            continue
        blk = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("attn_sub_norm.weight"):
            mapped = f"blk.{blk}.attn_sub_norm.weight"
        elif name.endswith("ffn_sub_norm.weight"):
            mapped = f"blk.{blk}.ffn_sub_norm.weight"
        else:
            mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"gguf has no name for {name}")
        if name.endswith(tuple(f"{n}.weight" for n in PRODUCTS)):
            values = weight_quant(values)
            if scales:
                scale = values.abs().max()  # (every nonzero value of a product is +-s)
                w.add_tensor(mapped.replace(".weight", ".scale"), np.array([scale.item()], dtype=np.float32))
                values = values / scale
            if ternary is not None:
                w.add_tensor(mapped, gguf.quants.quantize(np.ascontiguousarray(values.numpy()), ternary),
                             raw_dtype=ternary)
                continue
        w.add_tensor(mapped, np.ascontiguousarray(values.numpy()))
    _finish(w, (), None)
    return out


def _bitnet(tmp: Path, act: str = "silu") -> tuple[Any, Path]:
    import transformers as tf

    cfg = tf.BitNetConfig(**TINY, hidden_act=act, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return built(tmp, f"bitnet_{act}", tf.BitNetForCausalLM(cfg))


def test_a_bitnet_gguf_is_its_rounded_checkpoint(tmp_path: Path) -> None:  # the 1bitLLM form: SiLU, no key for it
    hf, folder = _bitnet(tmp_path)
    path = write_bitnet(hf, folder, tmp_path / "bitnet.gguf")
    assert read_back(rounded(hf), path) <= 1e-4
    assert read_back(hf, path) > 1e-2  # (the rounding shows: the file is not the unrounded checkpoint)


def test_a_relu2_bitnet_gguf_takes_its_activation_key(tmp_path: Path) -> None:  # bitnet-b1.58-2B-4T's activation
    hf, folder = _bitnet(tmp_path, "relu2")
    assert read_back(rounded(hf), write_bitnet(hf, folder, tmp_path / "relu2.gguf", activation="relu2")) <= 1e-4


def test_a_bitnet_gguf_of_ternary_values_and_scales_is_the_same_model(tmp_path: Path) -> None:
    hf, folder = _bitnet(tmp_path)
    assert read_back(rounded(hf), write_bitnet(hf, folder, tmp_path / "scales.gguf", scales=True)) <= 1e-4


@pytest.mark.parametrize("kind", ["TQ1_0", "TQ2_0"])
def test_a_bitnet_gguf_of_packed_ternary_products_is_its_rounded_checkpoint(tmp_path: Path, kind: str) -> None:
    import gguf
    import transformers as tf

    wide = {**TINY, "hidden_size": 256, "intermediate_size": 256}  # (rows of whole 256-value blocks)
    cfg = tf.BitNetConfig(**wide, hidden_act="silu", tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf, folder = built(tmp_path, "bitnet_wide", tf.BitNetForCausalLM(cfg))
    path = write_bitnet(hf, folder, tmp_path / f"{kind}.gguf", ternary=gguf.GGMLQuantizationType[kind])
    assert read_back(rounded(hf, half_scales=True), path) <= 1e-4


def test_a_bitnet_gguf_with_an_output_head_is_refused(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _bitnet(tmp_path)
    with pytest.raises(UnsupportedModelError, match="output.weight"):
        load(resolve(str(write_bitnet(hf, folder, tmp_path / "head.gguf", head=True))))
