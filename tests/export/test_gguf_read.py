"""GGUF files as llama.cpp's converter writes them (tests/gguf_files.py) read into the model they came from
(llmc/export/gguf_read.py): Gemma 4 and gpt-oss, which llmc reads itself, exactly; the families transformers' reader
handles with what it drops put back (rotary scaling, head and expert sizes, soft-caps, Gemma's query scale); some
exported through their engines; refused by name where the file does not say what the model is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf_files import (
    CONVERTED,
    round_experts_mxfp4,
    write_converted,
    write_family,
    write_gemma4,
    write_gpt_oss,
)
from tiny_models import make_model

from llmc.errors import InputError, UnsupportedModelError
from llmc.export.exporter import ExportConfig, export
from llmc.export.sources import load, resolve


def _hf(arch: str, tmp: Path) -> tuple[Any, Path]:
    from transformers import AutoModelForCausalLM

    folder = make_model(arch, tmp / arch)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                attn_implementation="eager").eval(), folder


IDS = np.random.default_rng(0).integers(3, 320, 40).tolist()  # past the sliding window (8)


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4_e", "gemma4_moe"])
def test_a_gemma4_gguf_reads_as_the_model_it_came_from(tmp_path: Path, arch: str) -> None:
    hf, folder = _hf(arch, tmp_path)
    path = write_gemma4(hf, folder, tmp_path / f"{arch}.gguf")
    src = resolve(str(path))
    assert src.kind == "gguf" and src.model_type == "gemma4_text"
    ours = load(src).model
    c, mine = hf.config, ours.config
    for key in ("layer_types", "num_kv_shared_layers", "attention_k_eq_v",
                "hidden_size_per_layer_input", "use_double_wide_mlp", "enable_moe_block", "final_logit_softcapping",
                "sliding_window", "tie_word_embeddings"):
        assert getattr(mine, key) == getattr(c, key), key
    for i in range(c.num_hidden_layers):
        for key in ("head_dim", "num_key_value_heads"):
            assert getattr(mine.per_layer_config[i], key) == getattr(c.per_layer_config[i], key), (i, key)
    assert mine.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.25
    with torch.no_grad():
        ref, got = hf(torch.tensor([IDS])).logits, ours(torch.tensor([IDS])).logits
        for name, value in hf.state_dict().items():  # every weight, the scalars and experts among them
            assert torch.equal(ours.state_dict()[name], value), name
    assert float((got - ref).abs().max()) == 0.0


def test_a_gemma4_gguf_exports(tmp_path: Path) -> None:
    """E2B / E4B's form (per-layer embeddings, KV-shared layers, double-wide MLPs) from its GGUF to an engine that
    computes the logits of the checkpoint it was converted from."""
    from llmc.engines.ort.build import export_engine

    hf, folder = _hf("gemma4_e", tmp_path)
    path = write_gemma4(hf, folder, tmp_path / "e.gguf")
    manifest = export(ExportConfig(str(path), tmp_path / "export"))
    assert manifest.parity["max_abs_diff"] <= 1e-4 and manifest.parity["greedy_match"] == 8
    engine = export_engine(manifest, tmp_path / "export")
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0, -1].numpy()
    assert float(np.abs(engine.prefill([0], [IDS], engine.new_kv_cache(1, 64))[0] - ref).max()) <= 1e-4


@pytest.mark.parametrize(("leave_out", "metadata", "error", "says"), [
    (("rope_freqs.weight",), None, UnsupportedModelError, "without rope_freqs.weight"),
    (("gemma4.attention.sliding_window_pattern",), None, UnsupportedModelError, "sliding_window_pattern"),
    (("gemma4.attention.key_length_swa",), None, InputError, "without gemma4.attention.key_length_swa"),
    ((), {"gemma4.attention.head_count_kv": [2, 1, 2, 2]}, UnsupportedModelError,
     r"head_count_kv differs between full layers \(\[1, 2\]\)"),
    ((), {"gemma4.attention.head_count_kv": [2, 1, 2]}, UnsupportedModelError, "has 3 values for 4 layers"),
    ((), {"gemma4.attention.key_length_swa": 8}, InputError,  # (the sliding layers' heads are 16 wide)
     r"does not match the weights: model.layers.0.self_attn.k_norm.weight is \[16\] in the weights, \[8\] by the "
     r"config \(12 tensors differ\)"),
])
def test_a_gemma4_gguf_that_does_not_say_what_the_model_is_is_refused(
        tmp_path: Path, leave_out: tuple[str, ...], metadata: dict[str, Any] | None, error: type,
        says: str) -> None:
    hf, folder = _hf("gemma4_text", tmp_path)
    path = write_gemma4(hf, folder, tmp_path / "m.gguf", leave_out=leave_out, metadata=metadata)
    with pytest.raises(error, match=says):
        export(ExportConfig(str(path), tmp_path / "export"))


def _gpt_oss(tmp: Path) -> tuple[Any, Path]:
    """A tiny gpt-oss with the family's values of what its GGUF does not carry: the SwiGLU limit (7), yarn without
    truncation, sliding and full layers alternating."""
    import transformers as tf
    from tiny_models import make_tokenizer

    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64}
    model = tf.GptOssForCausalLM(tf.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, rope_parameters=rope,
        tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(4.0) if p.dim() >= 2 else p.normal_(0.0, 2.0) if name.endswith("sinks") else None
    folder = tmp / "gpt_oss"
    model.save_pretrained(str(folder))
    make_tokenizer(folder, 320)
    return model.eval(), folder


@pytest.mark.parametrize("mxfp4", [False, True])
def test_a_gpt_oss_gguf_reads_as_the_model_it_came_from(tmp_path: Path, mxfp4: bool) -> None:
    """Its experts in F32, or in MXFP4 as published (the model's own rounded to it first)."""
    from llmc.engines.ort.build import export_engine

    hf, folder = _gpt_oss(tmp_path)
    if mxfp4:
        round_experts_mxfp4(hf)
    path = write_gpt_oss(hf, folder, tmp_path / "gpt-oss.gguf", mxfp4=mxfp4)
    src = resolve(str(path))
    assert src.model_type == "gpt_oss"
    ours = load(src).model
    assert ours.config.rope_parameters == hf.config.rope_parameters
    assert ours.config.layer_types == hf.config.layer_types and ours.config.swiglu_limit == 7.0
    with torch.no_grad():
        for name, value in hf.state_dict().items():  # the experts, their biases and the sinks among them
            assert torch.equal(ours.state_dict()[name], value), name
        assert float((ours(torch.tensor([IDS])).logits - hf(torch.tensor([IDS])).logits).abs().max()) == 0.0
    manifest = export(ExportConfig(str(path), tmp_path / "export"))
    assert manifest.parity["max_abs_diff"] <= 1e-4
    engine = export_engine(manifest, tmp_path / "export")
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0, -1].numpy()
    assert float(np.abs(engine.prefill([0], [IDS], engine.new_kv_cache(1, 64))[0] - ref).max()) <= 1e-4


def test_a_gpt_oss_gguf_without_yarn_is_refused(tmp_path: Path) -> None:
    hf, folder = _gpt_oss(tmp_path)
    path = write_gpt_oss(hf, folder, tmp_path / "gpt-oss.gguf", leave_out=("gpt-oss.rope.scaling.type",))
    with pytest.raises(UnsupportedModelError, match="rope.scaling.type 'none': gpt-oss rotates with yarn"):
        export(ExportConfig(str(path), tmp_path / "export"))


def _family(tmp: Path, name: str) -> tuple[Any, Path]:
    """Tiny models of the families transformers' GGUF reader handles, with the values their files carry or that
    llama.cpp takes for them (Gemma's query scale: the head size below 27B)."""
    import transformers as tf
    from tiny_models import make_tokenizer

    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    gemma3_rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    gpt2 = dict(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2)
    falcon = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, bias=False,
                  ffn_hidden_size=256, bos_token_id=1, eos_token_id=2)  # (4 x the width: the converter writes so)
    quarter = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    mamba = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, state_size=16, expand=2, conv_kernel=4,
                 time_step_rank=8, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = {
        "llama3": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None)),
        "qwen2_yarn": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, rope_parameters=yarn)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(
            **common, head_dim=32, query_pre_attn_scalar=32, sliding_window=8, attn_logit_softcapping=5.0,
            final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh")),
        "phi3_longrope": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(
            **common, sliding_window=48, tie_word_embeddings=False, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 64, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0]})),
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            norm_topk_prob=True, tie_word_embeddings=False)),
        "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            shared_expert_intermediate_size=80, norm_topk_prob=False, tie_word_embeddings=False)),
        "lfm2": lambda: tf.Lfm2ForCausalLM(tf.Lfm2Config(
            **{**common, "num_hidden_layers": 3}, layer_types=["conv", "full_attention", "conv"],
            block_multiple_of=32, norm_eps=1e-3)),  # (no conv biases, as published: transformers' reader misnames them)
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 6}, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
            rope_parameters=gemma3_rope)),
        "llama_bias": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, attention_bias=True, mlp_bias=True)),
        # the families whose converter classes write keys of their own (gguf_files.write_converted)
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(**gpt2)),  # (256 positions: transformers' default 1,024)
        "gpt2_untied": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(**gpt2, tie_word_embeddings=False)),
        "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(  # (3B's rotary base)
            **common, sliding_window=None, hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 999999.4420358813})),
        "starcoder2_15b": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(
            **common, sliding_window=None, hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e5})),
        "falcon_7b": lambda: tf.FalconForCausalLM(tf.FalconConfig(**falcon, multi_query=True)),
        "falcon_40b": lambda: tf.FalconForCausalLM(tf.FalconConfig(  # (and 180B: two norms, KV heads in groups)
            **falcon, new_decoder_architecture=True, num_kv_heads=2, tie_word_embeddings=False)),
        "falcon2_11b": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            **falcon, new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1,
            tie_word_embeddings=False)),
        "stablelm2_1_6b": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(
            **common, use_qkv_bias=True, use_parallel_residual=False, rope_parameters=quarter)),
        "stablelm2_12b": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(
            **common, use_parallel_residual=True, qk_layernorm=True, rope_parameters=quarter)),
        "nemotron_bias": lambda: tf.NemotronForCausalLM(tf.NemotronConfig(
            **common, attention_bias=True, mlp_bias=True, hidden_act="relu2",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
        "mamba": lambda: tf.MambaForCausalLM(tf.MambaConfig(**mamba)),  # (as published: no projection biases)
        "mamba_biased": lambda: tf.MambaForCausalLM(tf.MambaConfig(**mamba, use_bias=True)),
        # (llama.cpp normalizes the mixer's dt, B and C with the blocks' epsilon, the only one in the file)
        "falcon_mamba": lambda: tf.FalconMambaForCausalLM(tf.FalconMambaConfig(**mamba, mixer_rms_eps=1e-5)),
    }[name]()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
            elif p.dim() == 1:  # (norm weights away from 0 and 1)
                p.add_(0.3 * torch.randn_like(p))
    folder = tmp / name
    model.save_pretrained(str(folder))
    make_tokenizer(folder, 320)
    return model.eval(), folder


@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2_yarn", "qwen3", "qwen3_moe", "qwen2_moe", "lfm2", "gemma2", "gemma3",
                                  "phi3_longrope", "llama_bias", "gpt2", "gpt2_untied", "starcoder2", "starcoder2_15b",
                                  "falcon_7b", "falcon_40b", "falcon2_11b", "stablelm2_1_6b", "stablelm2_12b",
                                  "nemotron_bias", "mamba", "mamba_biased", "falcon_mamba"])
def test_a_gguf_of_a_family_transformers_reads_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    """transformers' reader drops the rotary scaling (Llama 3's `rope_freqs`, a yarn or linear `rope.scaling`:
    Gemma 3 4B-27B's full layers, Phi-3's longrope factors), the rotary base (StarCoder2's), Qwen3's head size,
    Gemma 2's soft-caps, Gemma's query scale, Phi's rotated share and window, GPT-2's positions, the biases of
    Llama, Nemotron and Mamba files, StableLM 2 12B's q / k norms, a Falcon Mamba file's mixer norms (it reads the
    file as Mamba), and reads every Falcon file as 7B's form with a tied head and its q / k / v rows in llama.cpp's
    order; llmc puts them back. 100 positions: past the windows and
    past the original contexts of yarn, llama3 and longrope (where its long factors take over)."""
    hf, folder = _family(tmp_path, name)
    writer = write_converted if hf.config.model_type in CONVERTED else write_family
    path = writer(hf, folder, tmp_path / f"{name}.gguf")
    ours = load(resolve(str(path))).model
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings  # (the export believes it)
    # (a Mistral file is read as Llama or as Mistral, never with MistralConfig's default window of 4,096: llama.cpp
    # attends to every key of a "llama" file)
    assert getattr(ours.config, "sliding_window", None) == getattr(hf.config, "sliding_window", None)
    ids = torch.tensor([np.random.default_rng(1).integers(3, 320, 100).tolist()])
    with torch.no_grad():
        assert float((ours(ids).logits - hf(ids).logits).abs().max()) <= 1e-4


def test_gemma_27b_files_scale_queries_by_hidden_over_heads(tmp_path: Path) -> None:
    """llama.cpp tells a Gemma 3 27B file by its 62 layers and scales its queries by hidden / heads (168 for the
    checkpoint, whose heads are 128 wide); below it by the head size."""
    import transformers as tf
    from tiny_models import make_tokenizer

    from llmc.export.gguf_read import transformers_config

    for layers, scale in ((62, 16), (6, 32)):
        cfg = tf.Gemma3TextConfig(vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=8,
                                  query_pre_attn_scalar=scale)
        model = tf.Gemma3ForCausalLM(cfg)
        folder = tmp_path / str(layers)
        model.save_pretrained(str(folder))
        make_tokenizer(folder, 320)
        path = write_family(model, folder, tmp_path / f"{layers}.gguf")
        assert transformers_config(path, "gemma3_text").query_pre_attn_scalar == scale


def test_a_llama3_gguf_exports_with_its_rotary_scaling(tmp_path: Path) -> None:
    """The engine of a Llama 3.x file (its scaling only in `rope_freqs`) computes the checkpoint's logits."""
    from llmc.engines.ort.build import export_engine

    hf, folder = _family(tmp_path, "llama3")
    manifest = export(ExportConfig(str(write_family(hf, folder, tmp_path / "l.gguf")), tmp_path / "export"))
    engine = export_engine(manifest, tmp_path / "export")
    ids = np.random.default_rng(1).integers(3, 320, 100).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
    assert float(np.abs(engine.prefill([0], [ids], engine.new_kv_cache(1, 128))[0] - ref).max()) <= 1e-4


@pytest.mark.parametrize(("name", "metadata", "says"), [
    ("qwen2_yarn", {"qwen2.rope.scaling.type": "dynamic"}, "qwen2.rope.scaling.type 'dynamic': llmc reads linear, "
                                                          "yarn and longrope scaling"),
    ("llama3", {"llama.rope.dimension_count": 8}, "llama.rope.dimension_count 8 rotated dims, transformers' model "
                                                  "rotates 16"),
])
def test_a_gguf_whose_rotary_llmc_does_not_read_is_refused(tmp_path: Path, name: str, metadata: dict[str, Any],
                                                          says: str) -> None:
    hf, folder = _family(tmp_path, name)
    path = write_family(hf, folder, tmp_path / "m.gguf", metadata=metadata)
    with pytest.raises(UnsupportedModelError, match=says):
        export(ExportConfig(str(path), tmp_path / "export"))


def test_a_gguf_with_tensors_transformers_reads_no_place_for_is_refused(tmp_path: Path) -> None:
    """transformers' loader passes over a tensor its map has no place for (here q norms in a Llama file, which
    llama.cpp refuses too): the model it built would not be the file's."""
    hf, folder = _family(tmp_path, "mistral")
    path = write_family(hf, folder, tmp_path / "m.gguf", extra={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)})
    with pytest.raises(UnsupportedModelError, match=r"without 1 of the file's tensors \(blk\.0\.attn_q_norm\.weight\)"):
        load(resolve(str(path)))


def test_a_falcon_gguf_with_linear_biases_is_refused(tmp_path: Path) -> None:
    """Falcon-RW's form: llama.cpp's Falcon has no place for linear biases."""
    import transformers as tf
    from tiny_models import make_tokenizer

    hf = tf.FalconForCausalLM(tf.FalconConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              ffn_hidden_size=256, bias=True, multi_query=True))
    hf.save_pretrained(str(tmp_path / "f"))
    make_tokenizer(tmp_path / "f", 320)
    path = write_converted(hf, tmp_path / "f", tmp_path / "f.gguf")
    with pytest.raises(UnsupportedModelError, match="attn_output.bias: llama.cpp's Falcon has no linear biases"):
        load(resolve(str(path)))
