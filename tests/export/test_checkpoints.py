"""Checkpoints as they are published: bf16 / fp16 / fp32 safetensors, sharded with an index, several EOS ids;
options a supported family may carry that llmc does not implement are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import make_tokenizer

from llmc.errors import InputError, UnsupportedModelError
from llmc.export.exporter import ExportConfig, export


def _tiny(out: Path, dtype: torch.dtype, shard: str | None, **config: Any) -> Any:
    """A tiny Qwen3 (qk-norm, its own head_dim, untied) saved in `dtype`, in shards of `shard` bytes."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**common, "head_dim": 32, "tie_word_embeddings": False, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model = model.to(dtype)
    model.save_pretrained(str(out), max_shard_size=shard) if shard else model.save_pretrained(str(out))
    make_tokenizer(out, 320)
    return model


@pytest.mark.parametrize(("dtype", "shard"), [(torch.bfloat16, "60KB"), (torch.float16, None), (torch.float32, "90KB")])
def test_published_checkpoints_export_exactly(tmp_path: Path, dtype: torch.dtype, shard: str | None) -> None:
    from transformers import AutoModelForCausalLM

    _tiny(tmp_path / "hf", dtype, shard)
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert (len(files) > 1) is (shard is not None) and ((tmp_path / "hf" / "model.safetensors.index.json").is_file()
                                                         is (shard is not None))
    manifest = export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    assert manifest.parity["max_abs_diff"] <= 1e-4 and manifest.parity["greedy_match"] == 8
    # the export's graphs against transformers reading the same files in fp32
    from llmc.engines.ort.build import export_engine

    engine = export_engine(manifest, tmp_path / "export")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, 320, 40).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
    ours = engine.prefill([0], [ids], engine.new_kv_cache(1, 64))[0]
    assert float(np.abs(ours - ref).max()) <= 1e-4


def test_every_eos_id_of_generation_config(tmp_path: Path) -> None:
    _tiny(tmp_path / "hf", torch.float32, None)
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 7, 11]}))
    manifest = export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    assert manifest.generation.eos_token_ids == (2, 7, 11)


@pytest.mark.parametrize(("config", "words"), [
    ({"use_bidirectional_attention": True}, ["use_bidirectional_attention", "causal"]),
    ({"use_bidirectional_attention": "all"}, ["use_bidirectional_attention = 'all'", "causal"]),
])
def test_an_option_llmc_does_not_implement_is_refused_by_name(tmp_path: Path, config: dict[str, Any],
                                                              words: list[str]) -> None:
    _tiny(tmp_path / "hf", torch.float32, None, **config)
    with pytest.raises(UnsupportedModelError) as e:
        export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_attention_biases_export_exactly(tmp_path: Path) -> None:
    """attention_bias: q/k/v and o_proj biases (was refused: "biases outside q/k/v are not implemented")."""
    from llmc.engines.ort.graphs import load_checkpoint

    _tiny(tmp_path / "hf", torch.float32, None, attention_bias=True)
    manifest = export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    assert manifest.parity["max_abs_diff"] <= 1e-4 and manifest.parity["greedy_match"] == 8
    weights = load_checkpoint(tmp_path / "export", manifest).weights
    assert {"layers.0.qkv.bias", "layers.0.o.bias", "layers.1.o.bias"} <= set(weights)


def _snap_to_q8_0(model: Any) -> None:
    """The input embedding on GGUF Q8_0's grid (int8 per value, an fp16 scale per 32 with its block's max at 127)."""
    with torch.no_grad():
        w = model.get_input_embeddings().weight
        blocks = w.reshape(w.shape[0], -1, 32)
        d = (blocks.abs().amax(-1, keepdim=True) / 127).to(torch.float16).to(torch.float32)
        safe = torch.where(d > 0, d, torch.ones_like(d))  # the padding row's zeros stay zeros
        w.copy_((torch.round(blocks / safe) * d).reshape(w.shape))


@pytest.mark.parametrize("table", ["bf16", "q8_0", "fp32"])
def test_the_engine_looks_embeddings_up_in_their_exact_compact_form(tmp_path: Path, table: str) -> None:
    """A bf16 checkpoint's embedding is looked up as bf16, a Q8_0-grid one as int8 + fp16 scales (a quarter of the
    bytes), any other in fp32; the built engine's logits are transformers' either way."""
    import onnx

    from llmc.engines.ort.build import BuildConfig, build_ort

    model = _tiny(tmp_path / "hf", torch.bfloat16 if table == "bf16" else torch.float32, None)
    if table == "q8_0":
        _snap_to_q8_0(model)
        model.save_pretrained(str(tmp_path / "hf"))
    export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    build_ort(BuildConfig(tmp_path / "export", tmp_path / "engine", attention="gqa"))
    graph = onnx.load(str(tmp_path / "engine" / "model.onnx"), load_external_data=False).graph
    names = {i.name for i in graph.initializer}
    want = {"bf16": {"embed.weight.bf16"}, "q8_0": {"embed.weight.q8", "embed.weight.q8scales"}, "fp32": set()}
    assert {n for n in names if n.startswith("embed.weight.")} == want[table]
    _assert_logits_are_transformers(tmp_path, seed=1)


@pytest.mark.parametrize("case", ["untied", "tied", "tied-q8_0"])
def test_a_large_fp32_head_runs_as_row_slices_with_the_same_logits(tmp_path: Path, case: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 head over HEAD_PART_BYTES is stored and run as row slices (one Gemm each, logits concatenated, so
    loading peaks at one slice above the engine), the head stored once either way: a tied head is sliced only when
    the embedding is looked up in its compact form. The logits are transformers'."""
    import onnx

    from llmc.engines.ort import graphs
    from llmc.engines.ort.build import BuildConfig, build_ort

    model = _tiny(tmp_path / "hf", torch.float32, None, tie_word_embeddings=case != "untied")
    if case == "tied-q8_0":
        _snap_to_q8_0(model)
        model.save_pretrained(str(tmp_path / "hf"))
    export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    head = 320 * 64 * 4  # the tiny model's [V, Hd] fp32 bytes
    monkeypatch.setattr(graphs, "HEAD_PART_BYTES", head // 3 + 1)  # 3 slices, the last one shorter
    build_ort(BuildConfig(tmp_path / "export", tmp_path / "engine", attention="gqa"))
    graph = onnx.load(str(tmp_path / "engine" / "model.onnx"), load_external_data=False).graph
    sizes = {i.name: int(np.prod(i.dims)) for i in graph.initializer}
    parts = sorted(n for n in sizes if n.startswith("lm_head.part"))
    assert parts == ([] if case == "tied" else ["lm_head.part0", "lm_head.part1", "lm_head.part2"])
    fp32_heads = sum(v for n, v in sizes.items() if n.startswith("lm_head.") or n in ("embed.weight", "lm_head.weight"))
    assert fp32_heads == 320 * 64 * (2 if case == "untied" else 1)  # untied: the embedding and the head
    _assert_logits_are_transformers(tmp_path, seed=2)


def _assert_logits_are_transformers(tmp_path: Path, seed: int) -> None:
    """The engine in tmp_path/engine gives tmp_path/hf's last-position logits (fp32 transformers) to 1e-4."""
    from transformers import AutoModelForCausalLM

    from llmc.engines.registry import load_engine_dir

    engine = load_engine_dir(tmp_path / "engine")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = np.random.default_rng(seed).integers(3, 320, 24).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
    ours = engine.prefill([0], [ids], engine.new_kv_cache(1, 32))[0]
    assert float(np.abs(ours - ref).max()) <= 1e-4


def _export_widened(model: Any, tmp_path: Path) -> Any:
    """`model`'s matrices times 4 (random init is near-uniform: greedy paths decisive), saved with a tokenizer into
    tmp_path/hf and exported into tmp_path/export; returns the export's manifest."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(str(tmp_path / "hf"))
    make_tokenizer(tmp_path / "hf", 320)
    return export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))


def test_gpt_bigcode_with_a_kv_head_per_head_and_unscaled_scores(tmp_path: Path) -> None:
    """The tiny gpt_bigcode of the parity tests has one KV head; here every head has its own (q/k/v rows interleaved
    per head, as GPT-NeoX's) and the scores are not scaled (`scale_attn_weights` false)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
        vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=False, scale_attn_weights=False,
        bos_token_id=1, eos_token_id=2))
    manifest = _export_widened(model, tmp_path)
    assert (manifest.model.num_kv_heads, manifest.model.attention_scale) == (4, 1.0)
    assert manifest.parity["max_abs_diff"] <= 1e-4 and manifest.parity["greedy_match"] == 8


def _as_mxfp4(folder: Path, out: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """`folder`'s tiny gpt-oss saved again as its checkpoints are published: every expert matrix in MXFP4 (4-bit
    E2M1 codes two a byte, [E, out, in / 32, 16], and an 8-bit power-of-two scale a block of 32, [E, out, in / 32])
    under quantization_config mxfp4. Returns the experts' values those codes stand for, in transformers' layout."""
    import shutil

    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(folder, out)
    weights, rng, values = load_file(str(out / "model.safetensors")), np.random.default_rng(seed), {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = weights.pop(name).shape  # [E, in, out]
        codes = rng.integers(0, 16, (e, n, k // 32, 32), dtype=np.uint8)
        blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scales = rng.integers(125, 130, (e, n, k // 32), dtype=np.uint8)
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
        values[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                  dtype=torch.float32).numpy()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return values


def test_an_mxfp4_checkpoint_exports_its_experts_exactly(tmp_path: Path) -> None:
    """gpt-oss publishes its experts in MXFP4: they are dequantized as they load (each value a 4-bit code times a
    power of two, exact in fp32) whatever kernels the machine has, and the export is the model's."""
    from tiny_models import make_model

    values = _as_mxfp4(make_model("gpt_oss", tmp_path / "hf"), tmp_path / "mxfp4")
    _assert_exports_as_its_values(tmp_path, tmp_path / "mxfp4", values)


def _assert_exports_as_its_values(tmp_path: Path, packed: Path, values: dict[str, np.ndarray]) -> None:
    """The pre-quantized folder `packed` exports (passing its golden check) to exactly the weights that tmp_path/hf
    does with `values` (what its codes stand for) written over its own in fp32."""
    from safetensors.numpy import load_file, save_file

    from llmc.engines.ort.graphs import load_checkpoint

    manifest = export(ExportConfig(str(packed), tmp_path / "export"))
    assert manifest.parity["max_abs_diff"] <= 1e-4 and manifest.parity["greedy_match"] == 8
    plain = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert any(not np.array_equal(v, plain[k]) for k, v in values.items() if k in plain)  # (the codes moved them)
    save_file({**plain, **values}, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    reference = export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export-fp32"))
    ours = load_checkpoint(tmp_path / "export", manifest).weights
    theirs = load_checkpoint(tmp_path / "export-fp32", reference).weights
    assert manifest.model == reference.model and ours.keys() == theirs.keys()
    for name, w in theirs.items():
        np.testing.assert_array_equal(ours[name], w, err_msg=name)


def test_other_quantized_checkpoints_are_refused_naming_the_method(tmp_path: Path) -> None:
    _tiny(tmp_path / "hf", torch.float32, None)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"quantization_config.quant_method 'awq' is not supported: llmc exports "
                                         r"unquantized weights"):
        export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))


# kind: (transformers' class prefix, the language model's type, the vision encoder's type where the config needs it,
# more of the config)
OTHER_IMAGE_TEXT: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llava": ("Llava", "llama", "clip_vision_model", {"image_token_index": 300}),
    "llava_next": ("LlavaNext", "mistral", "clip_vision_model", {"image_token_index": 300,
                                                                 "image_grid_pinpoints": [[32, 32]]}),
    "llava_onevision": ("LlavaOnevision", "qwen2", "siglip_vision_model",
                        {"image_token_index": 300, "video_token_index": 301, "image_grid_pinpoints": [[32, 32]]}),
    "smolvlm": ("SmolVLM", "llama", "", {"image_token_id": 300}),
    "idefics3": ("Idefics3", "llama", "", {"image_token_id": 300}),
    "internvl": ("InternVL", "qwen2", "", {"image_token_id": 300}),
    "aya_vision": ("AyaVision", "cohere2", "siglip_vision_model", {"image_token_index": 300}),
    "lfm2_vl": ("Lfm2Vl", "lfm2", "siglip2_vision_model", {"image_token_id": 300, "projector_hidden_size": 64})}


def _tiny_image_text(out: Path, kind: str) -> Any:
    """A tiny Gemma 3 (4B+'s form), Mistral 3, Qwen2.5-VL (its language model's fields at the config's top level,
    as published) or Qwen3-VL image-text model (a one-layer vision encoder), saved with a tokenizer; returns it (fp32,
    eval)."""
    import transformers as tf

    torch.manual_seed(0)
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    if kind == "gemma3":
        config: Any = tf.Gemma3Config(text_config={**text, "sliding_window": 8,
                                                   "layer_types": ["sliding_attention", "full_attention"]},
                                      vision_config=vision, mm_tokens_per_image=4, image_token_index=300,
                                      boi_token_index=301, eoi_token_index=302)
        model: Any = tf.Gemma3ForConditionalGeneration(config)
    elif kind == "gemma4":  # Gemma 4 E2B / E4B's form: per-layer embeddings, full layers of wider heads
        config = tf.Gemma4Config(text_config={**text, "sliding_window": 8, "global_head_dim": 32,
                                              "hidden_size_per_layer_input": 8,
                                              "use_bidirectional_attention": "vision",  # (text stays causal)
                                              "layer_types": ["sliding_attention", "full_attention"]},
                                 vision_config={**vision, "head_dim": 16}, audio_config=None)
        model = tf.Gemma4ForConditionalGeneration(config)
    elif kind == "apertus1p5":  # Apertus 1.5: discrete image and audio tokens past the text's, a head without them
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config = tf.Apertus1p5Config(
            text_config={**text, "output_vocab_size": 280, "rope_parameters": rope},
            vision_config=dict(codebook_size=16, embed_dim=8, latent_channels=32, base_channels=32,
                               channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[], resolution=16),
            audio_config=dict(model_type="wavtokenizer_encoder", codebook_size=16, codebook_dim=8, hidden_size=8,
                              num_filters=4, upsampling_ratios=[2, 2], num_lstm_layers=1),
            image_token_id=300, audio_token_id=301, image_token_offset=280, audio_token_offset=296)
        model = tf.Apertus1p5ForConditionalGeneration(config)
    elif kind == "qwen3_5":  # Qwen3.5's language model (Gated DeltaNet layers, gated attention) in its image-text model
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                "partial_rotary_factor": 0.5}
        config = tf.Qwen3_5Config(
            text_config={**text, "head_dim": 16, "rope_parameters": rope,
                         "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                         "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
            vision_config={**vision, "depth": 1, "num_heads": 2, "out_hidden_size": 64, "num_position_embeddings": 16},
            image_token_id=300, video_token_id=301, vision_start_token_id=302)
        model = tf.Qwen3_5ForConditionalGeneration(config)
    elif kind.startswith("qwen"):  # multimodal rotary sections (the same position in each on text)
        qwen3 = kind.startswith("qwen3")
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                **({"mrope_interleaved": True} if qwen3 else {})}
        vision = ({"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 8, "mlp_ratio": 2}
                  if kind == "qwen2_vl" else
                  {**vision, "depth": 1, "num_heads": 2, "out_hidden_size": 64,
                   **({"deepstack_visual_indexes": [0], "num_position_embeddings": 16} if qwen3 else
                      {"window_size": 16, "fullatt_block_indexes": [0]})})
        kinds: Any = {"qwen2_vl": (tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration),
                      "qwen2_5_vl": (tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration),
                      "qwen3_vl": (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration),
                      "qwen3_vl_moe": (tf.Qwen3VLMoeConfig, tf.Qwen3VLMoeForConditionalGeneration)}[kind]
        experts = ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
                   if kind == "qwen3_vl_moe" else {})
        config = kinds[0](text_config={**text, **experts, "rope_parameters": rope, "tie_word_embeddings": qwen3},
                          vision_config=vision, image_token_id=300, video_token_id=301, vision_start_token_id=302)
        model = kinds[1](config)
    elif kind in OTHER_IMAGE_TEXT:
        wrapper, text_type, vision_type, more = OTHER_IMAGE_TEXT[kind]
        vision = {**vision, **({"model_type": vision_type} if vision_type else {}),
                  **({"image_size": [32, 32], "patch_size": [8, 8]} if kind == "internvl" else {})}
        conv = {"layer_types": ["conv", "full_attention"]} if text_type == "lfm2" else {}  # (LFM2-VL's convolutions)
        config = getattr(tf, wrapper + "Config")(text_config={**text, "model_type": text_type, **conv},
                                                 vision_config=vision, **more)
        model = getattr(tf, wrapper + "ForConditionalGeneration")(config)
    elif kind == "llama4":  # Llama 4's language model: a whole causal LM inside (NoPE layer, experts on scaled inputs)
        config = tf.Llama4Config(
            text_config={**text, "intermediate_size": 32, "intermediate_size_mlp": 96, "num_local_experts": 4,
                         "num_experts_per_tok": 1, "moe_layers": [1], "no_rope_layers": [1, 0],
                         "attention_chunk_size": 128, "floor_scale": 256, "attn_temperature_tuning": True},
            vision_config={**vision, "vision_output_dim": 64, "projector_input_dim": 64, "projector_output_dim": 64,
                           "pixel_shuffle_ratio": 0.5}, image_token_index=300)
        model = tf.Llama4ForConditionalGeneration(config)
    elif kind.startswith("glm4v"):  # GLM-4.1V / 4.5V: GLM-4's (4.5's) language model, its rotary in sections
        moe = kind == "glm4v_moe"
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2] if moe else [2, 3, 3],
                "partial_rotary_factor": 0.5 if moe else 1.0}
        experts = (dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=1, topk_group=1, n_shared_experts=1) if moe else {})
        kinds = ((tf.Glm4vMoeConfig, tf.Glm4vMoeForConditionalGeneration) if moe else
                 (tf.Glm4vConfig, tf.Glm4vForConditionalGeneration))
        config = kinds[0](text_config={**text, **experts, "rope_parameters": rope},
                          vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                             out_hidden_size=64, patch_size=8, image_size=32))
        model = kinds[1](config)
    else:  # Ministral 3's language model in Mistral 3's wrapper (Mistral Small 3.1 has a Mistral one)
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.4}
        config = tf.Mistral3Config(text_config={**text, "model_type": "ministral3", "rope_parameters": rope},
                                   vision_config={**vision, "head_dim": 16}, image_token_index=300)
        model = tf.Mistral3ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(str(out))
    if kind == "qwen2_5_vl":
        saved = json.loads((out / "config.json").read_text())
        text_fields = saved.pop("text_config")
        (out / "config.json").write_text(json.dumps({**{k: v for k, v in text_fields.items() if k != "model_type"},
                                                     **saved}))
    make_tokenizer(out, 320)
    return model.eval()


@pytest.mark.parametrize("kind", ["gemma3", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v",
                                  "glm4v_moe", "llama4", "qwen3_5", "gemma4", "apertus1p5",
                                  *OTHER_IMAGE_TEXT])
def test_an_image_text_checkpoint_exports_its_language_model(tmp_path: Path, kind: str) -> None:
    """Gemma 3 4B-27B and Mistral Small 3.1 / Ministral 3 are published as image-text models: their language model is
    exported (text in, text out), its logits the image-text model's own on text, the image encoder left out."""
    from llmc.engines.ort.build import export_engine

    vlm = _tiny_image_text(tmp_path / "hf", kind)
    manifest = export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    assert manifest.model.hf_architecture == {"gemma3": "Gemma3ForCausalLM", "mistral3": "Ministral3ForCausalLM",
                                              "qwen2_vl": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM",
                                              "qwen3_vl": "Qwen3ForCausalLM",
                                              "qwen3_vl_moe": "Qwen3MoeForCausalLM", "llava": "LlamaForCausalLM",
                                              "llava_next": "MistralForCausalLM",
                                              "llava_onevision": "Qwen2ForCausalLM", "smolvlm": "LlamaForCausalLM",
                                              "idefics3": "LlamaForCausalLM", "internvl": "Qwen2ForCausalLM",
                                              "aya_vision": "Cohere2ForCausalLM", "glm4v": "Glm4ForCausalLM",
                                              "glm4v_moe": "Glm4MoeForCausalLM", "llama4": "Llama4ForCausalLM",
                                              "lfm2_vl": "Lfm2ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                                              "gemma4": "Gemma4ForCausalLM",
                                              "apertus1p5": "Apertus1p5TextForCausalLM"}[kind]
    if kind == "llama4":
        language, head = vlm.language_model.model, vlm.language_model.lm_head
    else:
        language, head = getattr(vlm.model, "language_model", None) or vlm.model.text_model, vlm.lm_head
    tied = head.weight.data_ptr() == language.embed_tokens.weight.data_ptr()
    assert manifest.model.tie_embeddings is tied
    assert manifest.parity["max_abs_diff"] <= 1e-4 and manifest.parity["greedy_match"] == 8
    engine = export_engine(manifest, tmp_path / "export")
    ids = np.random.default_rng(0).integers(3, 300, 40).tolist()  # (past 16 positions: Ministral 3's query scaling)
    with torch.no_grad():
        ref = vlm(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
    ours = engine.prefill([0], [ids], engine.new_kv_cache(1, 64))[0]
    assert float(np.abs(ours - ref).max()) <= 1e-4
    assert manifest.model.logits_size == (280 if kind == "apertus1p5" else 320)
    image = ("vision", "visual", "projector")
    vision = sum(p.numel() for n, p in vlm.named_parameters() if any(w in n for w in image))
    text = sum(p.numel() for n, p in vlm.named_parameters() if not any(w in n for w in image))
    assert vision > 0 and (tmp_path / "export" / "weights.bin").stat().st_size < 4 * (text + vision // 2)


def test_an_image_text_config_without_its_language_model_is_named(tmp_path: Path) -> None:
    _tiny_image_text(tmp_path / "hf", "gemma3")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "text_config": None}))
    with pytest.raises(InputError, match=r"config.json: a gemma3 config needs a text_config object"):
        export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))


def _as_fp8(folder: Path, out: Path, block: int = 32) -> dict[str, np.ndarray]:
    """`folder`'s tiny model saved again as DeepSeek-V3 and the "-FP8" releases publish theirs: every linear layer's
    weight in float8 e4m3 with an fp32 scale a block of block x block (`weight_scale_inv`), under quantization_config
    fp8. Returns the weights those codes stand for."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    weights, values = load_file(str(out / "model.safetensors")), {}
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        rows, cols = weights[name].shape
        blocks = weights[name].reshape(rows // block, block, cols // block, block)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # (e4m3's largest)
        codes = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        weights[name], weights[name.replace(".weight", ".weight_scale_inv")] = codes, scale
        values[name] = (codes.float().reshape(blocks.shape) * scale[:, None, :, None]).reshape(rows, cols).numpy()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block],
                                     "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(config))
    return values


def test_an_fp8_checkpoint_exports_the_values_its_codes_stand_for(tmp_path: Path) -> None:
    """Block-scaled FP8 checkpoints are dequantized as they load, whatever the machine has: the export is the same as
    from those values written in fp32."""
    from tiny_models import make_model

    values = _as_fp8(make_model("llama", tmp_path / "hf"), tmp_path / "fp8")
    _assert_exports_as_its_values(tmp_path, tmp_path / "fp8", values)


@pytest.mark.parametrize(("model_type", "family", "config"), [
    ("internlm3", "LlamaForCausalLM", {"rope_parameters": {"rope_type": "dynamic", "factor": 6.0, "rope_theta": 5e4}}),
    ("iquestcoder", "LlamaForCausalLM", {}),
    ("param2moe", "Glm4MoeForCausalLM", {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1}),
    ("sarvam_moe", "Glm4MoeForCausalLM", {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "first_k_dense_replace": 1}),
    ("sarvam_mla", "DeepseekV3ForCausalLM", {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                             "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 24,
                                             "v_head_dim": 16, "first_k_dense_replace": 1, "num_key_value_heads": 4}),
])
def test_a_model_type_built_as_another_family_exports_as_that_family(tmp_path: Path, model_type: str, family: str,
                                                                      config: dict[str, Any]) -> None:
    """InternLM3 and IQuest-Coder are Llama, Param2 and Sarvam-30B GLM-4.5, Sarvam-105B DeepSeek-V3: transformers has
    only their configs (and builds the family's modules); their exports are that family's, exact. InternLM3 ships
    "dynamic" NTK rotary, which is the default table up to max_position_embeddings (all an engine holds)."""
    import transformers as tf

    from llmc.engines.ort.build import export_engine

    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **{**common, **config}))
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.dim() >= 2:
                t.mul_(4.0)
            elif name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.3)
    model.save_pretrained(str(tmp_path / "hf"))
    make_tokenizer(tmp_path / "hf", 320)
    manifest = export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    assert manifest.model.hf_architecture == family == type(model).__name__
    assert manifest.parity["max_abs_diff"] <= 1e-4 and manifest.parity["greedy_match"] == 8
    engine = export_engine(manifest, tmp_path / "export")
    ids = np.random.default_rng(0).integers(3, 300, 60).tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
    ours = engine.prefill([0], [ids], engine.new_kv_cache(1, 64))[0]
    assert float(np.abs(ours - ref).max()) <= 1e-4


@pytest.mark.parametrize(("model_type", "config", "words"), [
    ("granite_swa", {"layer_rope_theta": [5000.0, 10000.0]}, ["layer_rope_theta", "5000"]),
    ("dbrx", {"attn_config": {"kv_n_heads": 2, "rope_theta": 500000.0},
              "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}},
     ["attn_config.rope_theta", "500000", "rope_parameters"]),
    ("mellum", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5,
                                                       "partial_rotary_factor": 0.5},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
     ["transformers' own forward fails", "RuntimeError"]),
    ("phimoe", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                    "long_factor": [2.0] * 8, "short_mscale": 1.2, "long_mscale": 1.3,
                                    "original_max_position_embeddings": 64}}, ["long_mscale", "1.3", "short_mscale"]),
])
def test_rotary_a_layer_cannot_have_in_llmc_is_refused_by_name(tmp_path: Path, model_type: str, config: dict[str, Any],
                                                               words: list[str]) -> None:
    """Granite SWA's per-layer rotary base other than rope_theta: refused (the export would rotate it by the model's
    one table), never exported wrong. DBRX's attn_config.rope_theta,
    which transformers does not use (it rotates by rope_parameters): refused while the two differ. PhiMoE's mscales
    that differ (the scale would change with the sequence's length): refused. Mellum with partial rotary on one layer
    type, which transformers builds but cannot run: its error in one line, not a traceback."""
    import transformers as tf

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])
    if model_type == "dbrx":  # (its own names)
        common = dict(vocab_size=320, d_model=64, n_layers=2, n_heads=4, max_seq_len=256)
    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **common, **config))
    model.save_pretrained(str(tmp_path / "hf"))
    make_tokenizer(tmp_path / "hf", 320)
    with pytest.raises(UnsupportedModelError) as e:
        export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_llama4_chunked_attention_and_query_temperature_are_transformers_on_every_lowering(tmp_path: Path) -> None:
    """Llama 4 past its attention chunk and its floor_scale: a rotated layer's query sees only its own block of 16
    keys (not a window: the span restarts at every multiple of 16), the layer without rotary scales its queries by
    1 + 0.5 log1p(floor((p + 1) / 8)); a 40-token prompt and decode steps to position 55 give transformers' logits
    through llmc's operator (prompt and decode paths), standard ONNX Attention (and its TensorRT-native form over the
    whole buffer) and the export's graphs; GroupQueryAttention, which has no chunks, is refused by name."""
    import transformers as tf
    from tiny_models import _llama4_text

    from llmc.engines.ort.build import build_ort
    from llmc.engines.ort.config import BuildConfig
    from llmc.engines.registry import load_engine_dir

    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = _llama4_text(tf, common, chunk=16, floor_scale=8)
    manifest = _export_widened(model, tmp_path)
    assert (manifest.model.attention_chunk, manifest.model.layer_types) == (
        16, ("chunked_attention", "chunked_attention", "full_attention"))
    ids = np.random.default_rng(2).integers(3, 300, 56).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    dense = model.config
    dense.attention_chunk_size = 1024  # (the same weights without chunks differ: the chunks bite)
    with torch.no_grad():
        unchunked = tf.AutoModelForCausalLM.from_config(dense)
        unchunked.load_state_dict(model.state_dict())
        assert float(np.abs(unchunked(torch.tensor([ids])).logits[0].numpy()[39:] - ref[39:]).max()) > 1e-2
    for attention in ("llmc", "onnx", "onnx-static", "concat"):
        layout = ({"kv_layout": "concat"} if attention == "concat" else  # (llmc's over an fp32 cache: exact)
                  {"attention": attention, **({"kv_dtype": "float32"} if attention == "llmc" else {})})
        build_ort(BuildConfig(tmp_path / "export", tmp_path / attention, **layout))
        engine = load_engine_dir(tmp_path / attention)
        kv = engine.new_kv_cache(1, 64)
        steps = [engine.prefill([0], [ids[:40]], kv)[0]] + [engine.decode([0], [[t]], kv)[0] for t in ids[40:55]]
        assert float(np.abs(np.stack(steps) - ref[39:55]).max()) <= 1e-4, attention
    with pytest.raises(InputError, match="--attention gqa"):
        build_ort(BuildConfig(tmp_path / "export", tmp_path / "gqa", attention="gqa"))


def test_layer_types_rotating_different_widths_export_exactly(tmp_path: Path) -> None:
    """Laguna's full layers rotating a quarter of each 32-dim head, its sliding ones half (a per-element output gate
    too): the narrower type's q / k rows and norm weights are reordered so that it rotates the wider type's width
    with zero frequencies past its own; the logits are transformers'."""
    import transformers as tf
    from tiny_models import _SLIDING_FULL, _auto

    from llmc.engines.ort.build import export_engine

    torch.manual_seed(0)
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    model = _auto(tf, "laguna", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, head_dim=32,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  rope_parameters=rope, mlp_layer_types=["dense", "sparse"], gating="per-element", **_SLIDING_FULL)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    manifest = _export_widened(model, tmp_path)
    assert manifest.model.rotary_dim == 16 and manifest.parity["max_abs_diff"] <= 1e-4
    engine = export_engine(manifest, tmp_path / "export")
    ids = np.random.default_rng(0).integers(3, 300, 40).tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
    assert float(np.abs(engine.prefill([0], [ids], engine.new_kv_cache(1, 64))[0] - ref).max()) <= 1e-4
