"""Tiny random-weight models of each supported architecture, with a real byte-level BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Hello world! 你好，世界 café naïve 👋🏽 emoji",
    "Once upon a time there was a tiny language model that wanted to be exported to ONNX.",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
              "model_max_length": 128}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def _qwen3(tf: Any, common: dict[str, Any]) -> Any:  # head_dim != hidden / heads, untied, windowed upper layer
    return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False,
                                              use_sliding_window=True, sliding_window=8, max_window_layers=1))


def _gemma(tf: Any, common: dict[str, Any]) -> Any:  # Gemma 1: 1 + w norms, scaled embeddings, GeGLU; one KV head
    return tf.GemmaForCausalLM(tf.GemmaConfig(**{**common, "num_key_value_heads": 1}, head_dim=16,
                                              hidden_act="gelu_pytorch_tanh"))


def _gemma2(tf: Any, common: dict[str, Any]) -> Any:  # sandwich norms, GeGLU, soft-caps, sliding / global layers
    return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=4.0,
                                                hidden_activation="gelu_pytorch_tanh"))


def _gemma3(tf: Any, common: dict[str, Any]) -> Any:  # + qk-norm, a local rotary base, linear scaling globally
    rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
                              sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters=rope)
    return tf.Gemma3ForCausalLM(cfg)


def _phi3(tf: Any, common: dict[str, Any]) -> Any:  # fused projections, partial rotary, longrope short/long factors
    half = 8  # rotated dims / 2: head_dim 32 x 0.5 = 16 rotated
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": 64}
    cfg = tf.Phi3Config(**{**common, "hidden_size": 128}, rope_parameters=rope, original_max_position_embeddings=64,
                        sliding_window=None, tie_word_embeddings=False)
    return tf.Phi3ForCausalLM(cfg)


def _smollm3(tf: Any, common: dict[str, Any]) -> Any:  # a NoPE layer
    return tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**common, no_rope_layers=[1, 0], tie_word_embeddings=True))


def _olmo2(tf: Any, common: dict[str, Any]) -> Any:  # norms after attention and MLP only, qk-norm over all of q / k
    return tf.Olmo2ForCausalLM(tf.Olmo2Config(**common))


def _granite(tf: Any, common: dict[str, Any]) -> Any:  # the four multipliers
    return tf.GraniteForCausalLM(tf.GraniteConfig(**common, embedding_multiplier=3.0, residual_multiplier=0.5,
                                                  attention_multiplier=0.2, logits_scaling=2.5,
                                                  tie_word_embeddings=True))


def _mixtral(tf: Any, common: dict[str, Any]) -> Any:  # 4 experts, 2 per token
    return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                  sliding_window=None))


def _granitemoe(tf: Any, common: dict[str, Any]) -> Any:  # Granite's multipliers on 4 experts, 2 per token
    return tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(
        **{**common, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=3.0))


def _qwen3_moe(tf: Any, common: dict[str, Any]) -> Any:  # experts without renormalized weights; a dense layer
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, norm_topk_prob=False,
                                                    decoder_sparse_step=1, mlp_only_layers=[1]))


def _qwen2_moe(tf: Any, common: dict[str, Any]) -> Any:  # + a shared expert behind a sigmoid gate, q/k/v bias
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                                    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1]))


def _phi(tf: Any, common: dict[str, Any]) -> Any:  # Phi-2: parallel blocks, partial rotary, biases, a head bias
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return tf.PhiForCausalLM(tf.PhiConfig(**common, hidden_act="gelu_new", rope_parameters=rope))


def _gpt_neox(tf: Any, common: dict[str, Any]) -> Any:  # Pythia: q/k/v interleaved per head, blocks in parallel
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    cfg = {k: v for k, v in common.items() if k != "num_key_value_heads"}
    return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**cfg, rope_parameters=rope, use_parallel_residual=True))


def _cohere(tf: Any, common: dict[str, Any]) -> Any:  # interleaved rotary, bias-free LayerNorm, parallel, logit scale
    return tf.CohereForCausalLM(tf.CohereConfig(**common, logit_scale=0.3))


def _opt(tf: Any, common: dict[str, Any]) -> Any:  # learned positions 2 rows in, ReLU, separate q/k/v, biases
    return tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=common["vocab_size"], hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=64, bos_token_id=1, eos_token_id=2, pad_token_id=0))


def _gpt_bigcode(tf: Any, common: dict[str, Any]) -> Any:  # StarCoder 1: GPT-2 with one KV head, Linear weights
    return tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(vocab_size=common["vocab_size"], n_embd=64, n_layer=2, n_head=4,
                                                        n_positions=256, multi_query=True, bos_token_id=1,
                                                        eos_token_id=2))


def _nemotron(tf: Any, common: dict[str, Any]) -> Any:  # LayerNorm of 1 + w, squared ReLU, partial rotary
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return tf.NemotronForCausalLM(tf.NemotronConfig(**common, head_dim=16, hidden_act="relu2", rope_parameters=rope))


def _glm(tf: Any, common: dict[str, Any]) -> Any:  # rotary over interleaved pairs of half of each head, q/k/v bias
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return tf.GlmForCausalLM(tf.GlmConfig(**common, head_dim=16, attention_bias=True, rope_parameters=rope))


def _glm4(tf: Any, common: dict[str, Any]) -> Any:  # + norms after attention and MLP too
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return tf.Glm4ForCausalLM(tf.Glm4Config(**common, head_dim=16, attention_bias=True, rope_parameters=rope))


def _helium(tf: Any, common: dict[str, Any]) -> Any:  # rotary over interleaved pairs, q/k/v bias
    return tf.HeliumForCausalLM(tf.HeliumConfig(**common, head_dim=16, attention_bias=True))


def _ernie4_5(tf: Any, common: dict[str, Any]) -> Any:  # rotary over interleaved pairs
    return tf.Ernie4_5ForCausalLM(tf.Ernie4_5Config(**common, head_dim=16, use_bias=False))


def _seed_oss(tf: Any, common: dict[str, Any]) -> Any:  # q/k/v and o biases
    return tf.SeedOssForCausalLM(tf.SeedOssConfig(**common, head_dim=16, attention_bias=True, attention_out_bias=True))


def _arcee(tf: Any, common: dict[str, Any]) -> Any:  # a plain squared-ReLU MLP
    return tf.ArceeForCausalLM(tf.ArceeConfig(**common, hidden_act="relu2"))


def _ministral(tf: Any, common: dict[str, Any]) -> Any:  # sliding and full layers by layer_types
    return tf.MinistralForCausalLM(tf.MinistralConfig(**common, head_dim=16, sliding_window=8,
                                                      layer_types=["sliding_attention", "full_attention"]))


def _exaone4(tf: Any, common: dict[str, Any]) -> Any:  # post norms, qk-norm, a sliding layer, a global NoPE layer
    return tf.Exaone4ForCausalLM(tf.Exaone4Config(**common, head_dim=16, sliding_window=8, sliding_window_pattern=2,
                                                  layer_types=["sliding_attention", "full_attention"]))


def _olmo(tf: Any, common: dict[str, Any]) -> Any:  # LayerNorm without weights, q/k/v clamped (tight: it bites)
    return tf.OlmoForCausalLM(tf.OlmoConfig(**common, clip_qkv=0.5))


def _stablelm(tf: Any, common: dict[str, Any]) -> Any:  # LayerNorm, partial rotary, parallel attention and MLP
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    return tf.StableLmForCausalLM(tf.StableLmConfig(**common, use_qkv_bias=True, use_parallel_residual=True,
                                                    rope_parameters=rope))


def _starcoder2(tf: Any, common: dict[str, Any]) -> Any:  # LayerNorm with bias, plain GELU MLP, biases, a window
    return tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**common, use_bias=True, hidden_act="gelu_pytorch_tanh",
                                                        sliding_window=16, norm_epsilon=1e-5))


def _olmo3(tf: Any, common: dict[str, Any]) -> Any:  # OLMo 2 with sliding and full layers, a table per layer type
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64}}
    return tf.Olmo3ForCausalLM(tf.Olmo3Config(**common, sliding_window=8, rope_parameters=rope,
                                              layer_types=["sliding_attention", "full_attention"]))


def _olmoe(tf: Any, common: dict[str, Any]) -> Any:  # qk-norm over all of q / k, then q, k, v clamped; no renorm
    return tf.OlmoeForCausalLM(tf.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2, clip_qkv=3.0,
                                              norm_topk_prob=False))


def _cohere2(tf: Any, common: dict[str, Any]) -> Any:  # Cohere's, sliding layers rotated, full ones without RoPE
    return tf.Cohere2ForCausalLM(tf.Cohere2Config(**common, sliding_window=8, logit_scale=0.25,
                                                  layer_types=["sliding_attention", "full_attention"]))


def _ernie4_5_moe(tf: Any, common: dict[str, Any]) -> Any:  # experts chosen by softmax + a bias, shared experts
    import torch

    model = tf.Ernie4_5_MoeForCausalLM(tf.Ernie4_5_MoeConfig(
        **common, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
        moe_layer_start_index=1, moe_layer_end_index=1, moe_layer_interval=1))
    with torch.no_grad():  # a correction bias that moves the choice (the probabilities are in (0, 1))
        model.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias.normal_(0.0, 0.3)
    return model


def _hunyuan_v1_dense(tf: Any, common: dict[str, Any]) -> Any:  # q and k normed after RoPE, NTK-alpha's base
    import torch

    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}
    model = tf.HunYuanDenseV1ForCausalLM(tf.HunYuanDenseV1Config(**common, head_dim=16, rope_parameters=rope,
                                                                 tie_word_embeddings=True))
    with torch.no_grad():  # norms of weights other than 1: with 1 they commute with the rotation (it keeps the RMS)
        for layer in model.model.layers:
            for n in (layer.self_attn.query_layernorm, layer.self_attn.key_layernorm):
                n.weight.uniform_(0.5, 1.5)
    return model


def _hunyuan_v1_moe(tf: Any, common: dict[str, Any]) -> Any:  # Hunyuan's attention, an fp32 router, a shared MLP
    import torch

    model = tf.HunYuanMoEV1ForCausalLM(tf.HunYuanMoEV1Config(**common, head_dim=16, num_experts=4, moe_topk=2,
                                                             num_shared_expert=1, tie_word_embeddings=True))
    with torch.no_grad():  # (as the dense one's: norms that do not commute with the rotation)
        for layer in model.model.layers:
            for n in (layer.self_attn.query_layernorm, layer.self_attn.key_layernorm):
                n.weight.uniform_(0.5, 1.5)
    return model


def _sigmoid_routed(model: Any) -> Any:
    """A correction bias that moves the choice of the sigmoid-routed layers (their scores are in (0, 1))."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return model


def _glm4_moe(tf: Any, common: dict[str, Any]) -> Any:  # sigmoid grouped routing, a shared expert, a dense layer
    return _sigmoid_routed(tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(
        **common, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})))


def _dots1(tf: Any, common: dict[str, Any]) -> Any:  # GLM-4.5's routing unnormalized, Qwen3's attention, a window
    return _sigmoid_routed(tf.Dots1ForCausalLM(tf.Dots1Config(
        **common, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
        topk_group=1, n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=False,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"])))


def _falcon(tf: Any, common: dict[str, Any]) -> Any:  # Falcon-40B's: q/k/v grouped per KV head, two parallel norms
    return tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=common["vocab_size"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, bias=True, ffn_hidden_size=96, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2))


def _falcon_mqa(tf: Any, common: dict[str, Any]) -> Any:  # Falcon-7B's: one KV head, attention and MLP off one norm
    return tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=common["vocab_size"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False, ffn_hidden_size=96,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2))


def _falcon_seq(tf: Any, common: dict[str, Any]) -> Any:  # q/k/v interleaved per head, one block after the other
    return tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=common["vocab_size"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True, ffn_hidden_size=96,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))


def _ministral3(tf: Any, common: dict[str, Any]) -> Any:  # yarn, queries scaled past 16 positions, a window
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4}
    return tf.Ministral3ForCausalLM(tf.Ministral3Config(**common, head_dim=16, rope_parameters=rope,
                                                        sliding_window=16))


def _afmoe(tf: Any, common: dict[str, Any]) -> Any:  # gated attention output, sandwich norms, NoPE full layer
    import torch

    model = tf.AfmoeForCausalLM(tf.AfmoeConfig(
        **{**common, "num_hidden_layers": 3}, head_dim=16, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1, route_scale=1.5, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], mup_enabled=True))
    with torch.no_grad():  # the expert bias (zeros) about the scores' spread, so that it moves the choice
        for layer in model.model.layers[1:]:
            layer.mlp.expert_bias.normal_(0.0, 0.3)
    return model


def _cwm(tf: Any, common: dict[str, Any]) -> Any:  # Llama's layer with sliding and full layers by layer_types
    return tf.CwmForCausalLM(tf.CwmConfig(**common, head_dim=16, sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"]))


def _vaultgemma(tf: Any, common: dict[str, Any]) -> Any:  # Gemma 2's layer, norms before attention and MLP only
    return tf.VaultGemmaForCausalLM(tf.VaultGemmaConfig(
        **common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=20.0,
        final_logit_softcapping=10.0, layer_types=["sliding_attention", "full_attention"]))


def _granitemoeshared(tf: Any, common: dict[str, Any]) -> Any:  # Granite MoE + a shared MLP (input_linear)
    return tf.GraniteMoeSharedForCausalLM(tf.GraniteMoeSharedConfig(
        **common, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0))


def _nanochat(tf: Any, common: dict[str, Any]) -> Any:  # weightless norms (one after the embedding), relu^2, soft-cap
    return tf.NanoChatForCausalLM(tf.NanoChatConfig(**common, final_logit_softcapping=15.0))


def _solar_open(tf: Any, common: dict[str, Any]) -> Any:  # GLM-4.5's routing in every layer, shared experts
    return _sigmoid_routed(tf.SolarOpenForCausalLM(tf.SolarOpenConfig(
        **common, head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5, norm_topk_prob=True)))


def _exaone(tf: Any, common: dict[str, Any]) -> Any:  # Llama's layer (make_model writes it as EXAONE 3.x publishes)
    return tf.LlamaForCausalLM(tf.ExaoneConfig(**common))


def _as_published_nemotron_h(out: Path) -> None:
    """The saved Nemotron-H model's config as NVIDIA publishes it (its weights transformers already saves so, under
    backbone.*, each expert's up_proj / down_proj apart): its blocks as hybrid_override_pattern (M: Mamba-2, *:
    attention, -: MLP, E: mixture) with num_hidden_layers (transformers maps both)."""
    config = json.loads((out / "config.json").read_text())
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    blocks = config.pop("layers_block_type")
    config.update(hybrid_override_pattern="".join(letters[t] for t in blocks), num_hidden_layers=len(blocks))
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _as_published_granite_hybrid(out: Path) -> None:
    """The saved Granite 4.0-H model's config as IBM publishes it: layer_types "mamba" / "attention" (transformers
    reads them as "linear_attention" / "full_attention"; its weights it already saves as published)."""
    config = json.loads((out / "config.json").read_text())
    names = {"linear_attention": "mamba", "full_attention": "attention"}
    config["layer_types"] = [names[t] for t in config["layer_types"]]
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _as_published_kimi_linear(out: Path) -> None:
    """The saved Kimi Linear model's config as Moonshot publishes it (its weights transformers already saves so: the
    forget gate's on the attention, q / k / v's convolutions apart, block_sparse_moe experts' w1 / w2 / w3): its
    linear layers in linear_attn_config (1-based layer numbers, head_dim, num_heads, short_conv_kernel_size), its
    dense layers by first_k_dense_replace."""
    config = json.loads((out / "config.json").read_text())
    types = config.pop("layer_types")
    dense = config.pop("mlp_layer_types").count("dense")
    config["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "head_dim": config.pop("linear_head_dim"), "num_heads": config.pop("linear_num_heads"),
        "short_conv_kernel_size": config.pop("linear_conv_kernel_dim")}
    config["first_k_dense_replace"] = dense
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _as_published_exaone(out: Path) -> None:
    """The saved EXAONE 3.x model under the names its checkpoints use (transformers renames them as it loads)."""
    from safetensors.torch import load_file, save_file

    names = (("model.embed_tokens.", "transformer.wte."), ("model.layers.", "transformer.h."),
             ("model.norm.", "transformer.ln_f."), (".self_attn.o_proj.", ".attn.attention.out_proj."),
             (".self_attn.", ".attn.attention."), (".input_layernorm.", ".ln_1."),
             (".post_attention_layernorm.", ".ln_2."), (".mlp.gate_proj.", ".mlp.c_fc_0."),
             (".mlp.up_proj.", ".mlp.c_fc_1."), (".mlp.down_proj.", ".mlp.c_proj."))
    weights = {}
    for key, value in load_file(str(out / "model.safetensors")).items():
        for ours, theirs in names:
            key = key.replace(ours, theirs)
        weights[key] = value
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    for ours, theirs in (("num_hidden_layers", "num_layers"), ("rms_norm_eps", "layer_norm_epsilon"),
                         ("hidden_act", "activation_function")):
        config[theirs] = config.pop(ours)
    (out / "config.json").write_text(json.dumps(config))


def _apertus(tf: Any, common: dict[str, Any]) -> Any:  # xIELU (its alphas per layer moved off their start), qk-norm
    import torch

    model = tf.ApertusForCausalLM(tf.ApertusConfig(**common, head_dim=16))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.act_fn.alpha_p.normal_(0.0, 0.5)
            layer.mlp.act_fn.alpha_n.normal_(0.0, 0.5)
    return model


def _gptj(tf: Any, common: dict[str, Any]) -> Any:  # rotary over interleaved pairs of part of each head, parallel
    return tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=common["vocab_size"], n_embd=64, n_layer=2, n_head=4,
                                            rotary_dim=8, n_inner=96, n_positions=256, bos_token_id=1,
                                            eos_token_id=2))


def _minimax_m2(tf: Any, common: dict[str, Any]) -> Any:  # sigmoid routing + correction bias, full qk-norm, partial
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    model = tf.MiniMaxM2ForCausalLM(tf.MiniMaxM2Config(**{**common, "intermediate_size": 32}, head_dim=16,
                                                       num_local_experts=8, num_experts_per_tok=2,
                                                       rope_parameters=rope))
    import torch

    with torch.no_grad():  # the block's correction bias (a buffer, zeros), about the scores' spread
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.normal_(0.0, 0.3)
    return model


MLA_DIMS = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=16)  # D = 40, V != nope


def _deepseek_v2(tf: Any, common: dict[str, Any]) -> Any:  # latent attention, one q product; softmax in groups
    return tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        **{**common, "num_key_value_heads": 4}, **MLA_DIMS, q_lora_rank=None, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=1, routed_scaling_factor=1.5))  # (k 2 > 1 group)


def _deepseek_v3(tf: Any, common: dict[str, Any]) -> Any:  # + q's low rank, YaRN's mscale in the scale, biases
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 64}
    return _sigmoid_routed(tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **{**common, "num_key_value_heads": 4}, **MLA_DIMS, q_lora_rank=32, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=rope, attention_bias=True)))


def _flex_olmo(tf: Any, common: dict[str, Any]) -> Any:  # OLMo 2's layer (norms after, full qk-norm), OLMoE's MoE
    return tf.FlexOlmoForCausalLM(tf.FlexOlmoConfig(**{**common, "intermediate_size": 32}, num_experts=8,
                                                    num_experts_per_tok=2, norm_topk_prob=False))


def _exaone_moe(tf: Any, common: dict[str, Any]) -> Any:  # EXAONE 4's attention (a NoPE full layer), grouped sigmoid
    return _sigmoid_routed(tf.ExaoneMoeForCausalLM(tf.ExaoneMoeConfig(
        **common, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])))


def _minicpm3(tf: Any, common: dict[str, Any]) -> Any:  # latent attention (halves), embedding / residual / logit scales
    return tf.MiniCPM3ForCausalLM(tf.MiniCPM3Config(
        **{**common, "num_key_value_heads": 4}, **MLA_DIMS, q_lora_rank=32, scale_emb=3.0, scale_depth=1.4,
        dim_model_base=16))


def _glm4_moe_lite(tf: Any, common: dict[str, Any]) -> Any:  # V3's, rotated in halves (rope_interleave off)
    return _sigmoid_routed(tf.Glm4MoeLiteForCausalLM(tf.Glm4MoeLiteConfig(
        **{**common, "num_key_value_heads": 4}, **MLA_DIMS, q_lora_rank=32, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
        topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True, rope_interleave=False)))


def _gpt_oss(tf: Any, common: dict[str, Any]) -> Any:  # sinks, biases, yarn, alternating windows, clamped experts
    import torch

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64}
    model = tf.GptOssForCausalLM(tf.GptOssConfig(
        **common, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
        swiglu_limit=3.0))
    with torch.no_grad():  # sinks about the scores' size, so that they move the weights
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


TINY_BUILDERS = {"qwen3": _qwen3, "gemma": _gemma, "gemma2": _gemma2, "gemma3_text": _gemma3, "phi": _phi,
                 "phi3": _phi3, "smollm3": _smollm3, "opt": _opt, "gpt_bigcode": _gpt_bigcode, "cohere": _cohere,
                 "nemotron": _nemotron, "glm": _glm, "glm4": _glm4, "helium": _helium, "ernie4_5": _ernie4_5,
                 "seed_oss": _seed_oss, "arcee": _arcee, "ministral": _ministral, "exaone4": _exaone4, "olmo": _olmo,
                 "stablelm": _stablelm, "gpt_neox": _gpt_neox, "starcoder2": _starcoder2, "olmo2": _olmo2,
                 "granite": _granite, "granitemoe": _granitemoe, "mixtral": _mixtral, "qwen2_moe": _qwen2_moe,
                 "qwen3_moe": _qwen3_moe, "gpt_oss": _gpt_oss,
                 "olmo3": _olmo3, "glm4_moe": _glm4_moe, "dots1": _dots1,
                 "olmoe": _olmoe, "cohere2": _cohere2, "ernie4_5_moe": _ernie4_5_moe,
                 "hunyuan_v1_dense": _hunyuan_v1_dense, "hunyuan_v1_moe": _hunyuan_v1_moe,
                 "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3, "glm4_moe_lite": _glm4_moe_lite,
                 "falcon": _falcon, "falcon_mqa": _falcon_mqa, "falcon_seq": _falcon_seq, "gptj": _gptj,
                 "minimax_m2": _minimax_m2, "ministral3": _ministral3, "apertus": _apertus,
                 "afmoe": _afmoe, "cwm": _cwm, "vaultgemma": _vaultgemma, "granitemoeshared": _granitemoeshared,
                 "nanochat": _nanochat, "solar_open": _solar_open, "exaone": _exaone,
                 "minicpm3": _minicpm3, "flex_olmo": _flex_olmo,
                 "exaone_moe": _exaone_moe}
def _auto(tf: Any, model_type: str, **config: Any) -> Any:
    """transformers' causal LM of `model_type` from its config class, with each learned sink about the scores' size
    and each sigmoid router's correction bias moved off zero (so that both change what the model computes)."""
    import torch

    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(model_type, **config))
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("self_attn.sinks"):
                t.normal_(0.0, 2.0)
            elif name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.3)
    return model


_SLIDING_FULL = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
_GRANITE_MULTIPLIERS = {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2}


def _granite_swa(tf: Any, common: dict[str, Any]) -> Any:  # sinks, sliding / full layers, a layer without rotary
    return _auto(tf, "granite_swa", **common, head_dim=16, **_SLIDING_FULL, **_GRANITE_MULTIPLIERS,
                 logits_scaling=1.5, layer_rope_theta=[0.0, 10000.0])


def _granitemoe_swa(tf: Any, common: dict[str, Any]) -> Any:  # Granite MoE's shared MLP with Granite SWA's attention
    return _auto(tf, "granitemoe_swa", **common, num_local_experts=4, num_experts_per_tok=2,
                 shared_intermediate_size=32, **_SLIDING_FULL, **_GRANITE_MULTIPLIERS, logits_scaling=1.5)


def _hyperclovax(tf: Any, common: dict[str, Any]) -> Any:  # Granite's multipliers, logits multiplied, post-norms
    return _auto(tf, "hyperclovax", **common, head_dim=16, **_GRANITE_MULTIPLIERS, logits_scaling=0.7,
                 use_post_norm=True)


def _jais2(tf: Any, common: dict[str, Any]) -> Any:  # LayerNorm with bias, biases everywhere, a plain relu^2 MLP
    return _auto(tf, "jais2", **common)


def _youtu(tf: Any, common: dict[str, Any]) -> Any:  # a dense decoder with DeepSeek-V3's latent attention
    return _auto(tf, "youtu", **{**common, "num_key_value_heads": 4}, **MLA_DIMS, q_lora_rank=32,
                 tie_word_embeddings=False)


def _minicpm5_moe(tf: Any, common: dict[str, Any]) -> Any:  # gated attention output, GLM-4.5's grouped mixture
    return _auto(tf, "minicpm5_moe", **common, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                 mlp_layer_types=["dense", "sparse"])


def _mellum(tf: Any, common: dict[str, Any]) -> Any:  # Qwen3-MoE with a rotary base per layer type, a dense layer
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    return _auto(tf, "mellum", **common, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 **_SLIDING_FULL, rope_parameters=rope, mlp_layer_types=["dense", "sparse"])


def _flint(tf: Any, common: dict[str, Any]) -> Any:  # sinks, RoPE on sliding layers only, sigmoid routing unbiased
    return _auto(tf, "flint", **common, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, **_SLIDING_FULL, mlp_only_layers=[0])


def _hy_v3(tf: Any, common: dict[str, Any]) -> Any:  # qk-norm, sigmoid routing + the block's bias, scaled, shared
    return _auto(tf, "hy_v3", **common, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 num_shared_experts=1, router_scaling_factor=2.0, mlp_layer_types=["dense", "sparse"])


def _kolibri1(tf: Any, common: dict[str, Any]) -> Any:  # EXAONE 4's attention, GLM-4's norms, logit-biased routing
    import torch

    model = _auto(tf, "kolibri1", **{k: v for k, v in common.items() if k != "intermediate_size"}, head_dim=16,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  norm_topk_prob=True, **_SLIDING_FULL)
    with torch.no_grad():  # a bias on the logits' scale, so that it changes the choice
        for name, t in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 2.0)
    return model


def _dbrx(tf: Any, common: dict[str, Any]) -> Any:  # fused q/k/v clamped, bias-free LayerNorm, experts as w1/v1/w2
    return tf.DbrxForCausalLM(tf.DbrxConfig(
        d_model=common["hidden_size"], n_heads=common["num_attention_heads"], n_layers=common["num_hidden_layers"],
        max_seq_len=common["max_position_embeddings"], vocab_size=common["vocab_size"],
        attn_config={"kv_n_heads": common["num_key_value_heads"], "clip_qkv": 1.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
        **{k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}))


def _cohere2_moe(tf: Any, common: dict[str, Any]) -> Any:  # a dense layer rotated, sliding rotated, full without
    return _auto(tf, "cohere2_moe", **{**common, "num_hidden_layers": 3}, head_dim=16, logit_scale=0.25,
                 num_experts=4, num_experts_per_tok=2, num_shared_experts=1, expert_selection_fn="sigmoid",
                 norm_topk_prob=False, rms_norm_eps=1e-5, prefix_dense_intermediate_size=64, sliding_window=8,
                 layer_types=["full_attention", "sliding_attention", "full_attention"],
                 mlp_layer_types=["dense", "sparse", "sparse"])


def _phimoe(tf: Any, common: dict[str, Any]) -> Any:  # sparsemixer routing, LayerNorm, biases, longrope's mscale
    import torch

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(8)],
            "long_factor": [2.0 + i / 4 for i in range(8)], "short_mscale": 1.25, "long_mscale": 1.25,
            "original_max_position_embeddings": 64}
    model = _auto(tf, "phimoe", **common, num_local_experts=4, num_experts_per_tok=2, rope_parameters=rope,
                  attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3)
    with torch.no_grad():  # norms' and biases' own values
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _llama4_text(tf: Any, common: dict[str, Any], chunk: int = 256, floor_scale: int = 512) -> Any:
    """NoPE layer, qk-norm on the others, experts on scaled inputs; its chunks (chunk < 256) and query temperature
    (floor_scale within the positions a test reaches) only where asked (GroupQueryAttention has no chunks)."""
    return _auto(tf, "llama4_text", **{**common, "num_hidden_layers": 3, "intermediate_size": 32}, head_dim=16,
                 intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=2, moe_layers=[1, 2],
                 no_rope_layers=[1, 1, 0], use_qk_norm=True, attn_temperature_tuning=True, floor_scale=floor_scale,
                 attn_scale=0.5, attention_chunk_size=chunk, tie_word_embeddings=False)


def _sparse_indexed(model_type: str) -> Any:  # DeepSeek-V3 with DSA's indexer (every key kept up to index_topk)
    def build(tf: Any, common: dict[str, Any]) -> Any:
        return _auto(tf, model_type, **{**common, "num_key_value_heads": 4}, **MLA_DIMS, q_lora_rank=32,
                     moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                     index_topk=128, index_head_dim=16, index_n_heads=2)
    return build


def _axk1(tf: Any, common: dict[str, Any]) -> Any:  # DeepSeek-V3 with the mixture's output normed
    import torch

    model = _auto(tf, "axk1", **{**common, "num_key_value_heads": 4}, **MLA_DIMS, q_lora_rank=32,
                  moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.0)
    with torch.no_grad():  # (the norm's own weights)
        for name, p in model.named_parameters():
            if name.endswith("post_mlp_layernorm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _mimo_v2_flash(tf: Any, common: dict[str, Any]) -> Any:  # KV heads, sinks per layer type; narrow scaled values
    rope = {t: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5}
            for t, theta in (("full_attention", 5e6), ("sliding_attention", 1e4))}
    return _auto(tf, "mimo_v2_flash", **{**common, "num_key_value_heads": 1}, head_dim=16, v_head_dim=8,
                 attention_value_scale=0.7, sliding_window=8, layer_types=["full_attention", "sliding_attention"],
                 rope_parameters=rope, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 n_group=2, topk_group=1, routed_scaling_factor=1.5, mlp_layer_types=["dense", "sparse"])


def _laguna(tf: Any, common: dict[str, Any]) -> Any:  # softplus gate per head, half-rotated full layers, sigmoid MoE
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    import torch

    model = _auto(tf, "laguna", **common, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, moe_routed_scaling_factor=1.5, rope_parameters=rope,
                  mlp_layer_types=["dense", "sparse"], **_SLIDING_FULL)
    with torch.no_grad():  # q's and k's norms per dim (reordered with them where a layer rotates part of a head)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _nudged(model: Any, biases: float = 0.0, dt_bias: float = 0.0) -> Any:
    """The model with every norm's weight moved by 0.3 N(0, 1) off its start (ones, or zeros where it multiplies by
    1 + w) and, where asked, its biases and Gated DeltaNet's dt_bias drawn from N(0, s): so that each one shows."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(0.3 * torch.randn_like(p))
            elif biases and name.endswith(".bias"):
                p.normal_(0.0, biases)
            elif dt_bias and name.endswith("dt_bias"):
                p.normal_(0.0, dt_bias)
    return model


def _lfm2(tf: Any, common: dict[str, Any]) -> Any:  # conv layers around an attention layer, biased convolutions
    model = _auto(tf, "lfm2", **{**common, "num_hidden_layers": 3}, layer_types=["conv", "full_attention", "conv"],
                  conv_bias=True, block_multiple_of=32)
    return _nudged(model, biases=0.2)


def _lfm2_moe(tf: Any, common: dict[str, Any]) -> Any:  # LFM2's layers, a dense MLP first, then experts
    import torch

    model = _auto(tf, "lfm2_moe", **{**common, "num_hidden_layers": 3}, layer_types=["conv", "full_attention", "conv"],
                  num_dense_layers=1, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  routed_scaling_factor=1.5)
    with torch.no_grad():  # (the expert bias off zero: it chooses)
        for name, t in model.named_buffers():
            if name.endswith("expert_bias"):
                t.normal_(0.0, 0.3)
    return model


def _lfm3(tf: Any, common: dict[str, Any]) -> Any:  # conv layers (4 taps), sliding and full layers, gates per head

    rope = {"full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    model = _auto(tf, "lfm3", **{**common, "num_hidden_layers": 4}, head_dim=16, conv_L_cache=4, sliding_window=8,
                  layer_types=["conv", "sliding_attention", "conv", "full_attention"], rope_parameters=rope,
                  use_attention_gate=True, use_sandwich_norm=True, attention_bias=True)
    return _nudged(model, biases=0.2)


def _qwen3_5_text(tf: Any, common: dict[str, Any]) -> Any:  # Gated DeltaNet layers around a gated attention layer
    model = _auto(tf, "qwen3_5_text", **{**common, "num_hidden_layers": 3}, head_dim=16,
                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4)
    return _nudged(model, dt_bias=0.5)  # (zero-centred norms and the gated norm off their start, dt_bias off 1)


def _qwen3_5_moe_text(tf: Any, common: dict[str, Any]) -> Any:  # Qwen3.5's layers, Qwen2-MoE's mixture
    return _auto(tf, "qwen3_5_moe_text", **common, head_dim=16, layer_types=["linear_attention", "full_attention"],
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32)


def _qwen3_next(tf: Any, common: dict[str, Any]) -> Any:  # fused GDN products, 2 value heads a key head, MoE
    model = _auto(tf, "qwen3_next", **{**common, "num_hidden_layers": 3}, head_dim=16,
                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True)
    return _nudged(model)  # (zero-centred norms and the gated norm off their start)


def _lara_mini(tf: Any, common: dict[str, Any]) -> Any:  # Gated DeltaNet, sliding and full layers, fp32 router
    model = _auto(tf, "lara_mini", **{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=8,
                  layer_types=["linear_attention", "sliding_attention", "full_attention"],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32)
    return _nudged(model, dt_bias=0.5)


def _granitemoehybrid(tf: Any, common: dict[str, Any]) -> Any:  # Mamba-2 layers (2 groups of B and C) around an
    # attention layer without positions, experts beside the shared MLP, Granite's multipliers
    model = _auto(tf, "granitemoehybrid", **{**common, "num_hidden_layers": 3, "intermediate_size": 32},
                  layer_types=["mamba", "attention", "mamba"], position_embedding_type="nope", mamba_n_heads=8,
                  mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                  num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                  embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)
    return _nudged(model, biases=0.2, dt_bias=0.5)


def _granitemoehybrid_dense(tf: Any, common: dict[str, Any]) -> Any:  # no experts: the shared MLP is the layer's;
    # rotary on its attention layer
    model = _auto(tf, "granitemoehybrid", **{**common, "num_hidden_layers": 2},
                  layer_types=["mamba", "attention"], position_embedding_type="rope", mamba_n_heads=4,
                  mamba_d_head=32, mamba_n_groups=1, mamba_d_state=32, mamba_d_conv=4, mamba_expand=2,
                  num_local_experts=0, shared_intermediate_size=96, embedding_multiplier=2.0)
    return _nudged(model, biases=0.2, dt_bias=0.5)


def _bamba(tf: Any, common: dict[str, Any]) -> Any:  # Mamba-2 layers with biased products around an attention
    # layer (half its head rotated), a SwiGLU MLP in every layer
    model = _auto(tf, "bamba", **{**common, "num_hidden_layers": 3}, attn_layer_indices=[1], mamba_n_heads=8,
                  mamba_d_head=16, mamba_n_groups=1, mamba_d_state=32, mamba_d_conv=3, mamba_proj_bias=True)
    return _nudged(model, biases=0.2, dt_bias=0.5)


def _nemotron_h(tf: Any, common: dict[str, Any]) -> Any:  # one mixer or MLP a block: Mamba-2 (2 groups), a
    # squared-ReLU MLP, attention without positions, Mamba-2, MLP
    model = _auto(tf, "nemotron_h", **{**common, "num_hidden_layers": 5},
                  layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp"], head_dim=16, mamba_num_heads=8,
                  mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, layer_norm_epsilon=1e-5)
    return _nudged(model, biases=0.2, dt_bias=0.5)


def _falcon_h1(tf: Any, common: dict[str, Any]) -> Any:  # attention and Mamba-2 side by side in each layer, every
    # muP multiplier off 1, the mixer without its norm (the published default), biased products
    model = _auto(tf, "falcon_h1", **common, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                  mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_proj_bias=True, projectors_bias=True,
                  attention_bias=True, embedding_multiplier=2.0, lm_head_multiplier=0.5, mlp_multipliers=[0.7, 1.3],
                  key_multiplier=0.8, attention_in_multiplier=1.2, attention_out_multiplier=0.9,
                  ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_in_multiplier=1.1, ssm_out_multiplier=0.7)
    return _nudged(model, biases=0.2, dt_bias=0.5)


def _falcon_h1_normed(tf: Any, common: dict[str, Any]) -> Any:  # the mixer's gated RMSNorm, normed before the gate
    model = _auto(tf, "falcon_h1", **common, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16,
                  mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=3, mamba_rms_norm=True,
                  mamba_norm_before_gate=True, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], ssm_out_multiplier=0.7)
    return _nudged(model, dt_bias=0.5)


def _kimi_linear(tf: Any, common: dict[str, Any]) -> Any:  # Kimi Delta Attention layers (a decay per key dim)
    # around a latent-attention layer without positions; a dense MLP first, then DeepSeek-V3's mixture (2 groups)
    model = _auto(tf, "kimi_linear", **{**common, "num_hidden_layers": 3, "num_key_value_heads": 4},
                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                  mlp_layer_types=["dense", "sparse", "sparse"], kv_lora_rank=32, q_lora_rank=None,
                  qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=16, linear_head_dim=32, linear_num_heads=4,
                  linear_conv_kernel_dim=4, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5)
    return _nudged(model, dt_bias=0.5)


def _olmo_hybrid(tf: Any, common: dict[str, Any]) -> Any:  # Gated DeltaNet layers normed before, an OLMo 3 attention
    # layer normed after, with rotary; beta doubled
    model = _auto(tf, "olmo_hybrid", **{**common, "num_hidden_layers": 3},
                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4}, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  linear_allow_neg_eigval=True)
    return _nudged(model, dt_bias=0.5)


def _nemotron_h_moe(tf: Any, common: dict[str, Any]) -> Any:  # Nemotron 3 Nano's blocks: a mixture block (ungated
    # squared-ReLU experts, DeepSeek-V3's router in 2 groups, a plain shared expert) among Mamba-2, attention, MLP
    model = _auto(tf, "nemotron_h", **{**common, "num_hidden_layers": 5},
                  layers_block_type=["mamba", "moe", "attention", "mamba", "mlp"], head_dim=16, mamba_num_heads=8,
                  mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_group=2,
                  topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True)
    return _nudged(model, biases=0.2, dt_bias=0.5)


def _mamba2(tf: Any, common: dict[str, Any]) -> Any:  # Mamba-2 alone: no attention, no MLP, no KV cache
    config = tf.AutoConfig.for_model("mamba2", vocab_size=common["vocab_size"], hidden_size=64, num_hidden_layers=3,
                                     num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2, conv_kernel=4,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _nudged(tf.AutoModelForCausalLM.from_config(config), dt_bias=0.5)


def _nemotron_h_latent(tf: Any, common: dict[str, Any]) -> Any:  # Nemotron 3 Super's latent experts: the mixture's
    # experts on a 32-wide projection of the hidden state, projected back
    model = _auto(tf, "nemotron_h", **{**common, "num_hidden_layers": 3},
                  layers_block_type=["mamba", "moe", "attention"], head_dim=16, mamba_num_heads=8, mamba_head_dim=8,
                  ssm_state_size=16, n_groups=2, conv_kernel=4, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_group=2, topk_group=1,
                  routed_scaling_factor=1.5, norm_topk_prob=True, moe_latent_size=32)
    return _nudged(model, biases=0.2, dt_bias=0.5)


def _scan_nudged(model: Any) -> Any:
    """A Mamba-1 model with its dt bias drawn from N(0, 0.5) (dt ~ softplus of it: decays that show over a few
    tokens, where the published initialisation keeps dt in [0.001, 0.1]), D moved off its start, A_log log(1..N)
    moved by 0.3 N(0, 1); A_log and the selective projections (x_proj, dt_proj) then quartered: make_model widens
    every matrix 4x, and at 4x they would make dt ~20 and the states ~1e4 (A = -n^4, fp32 keeping ~1e-4 of a
    logit)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_proj.bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(".D"):
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("A_log"):
                n = torch.arange(1, p.shape[1] + 1, dtype=p.dtype).log().expand_as(p)
                p.copy_((n + 0.3 * torch.randn_like(p)) / 4)
            elif name.endswith(("x_proj.weight", "dt_proj.weight")):
                p.div_(4.0)
    return model


def _mamba(tf: Any, common: dict[str, Any]) -> Any:  # Mamba-1 alone: no attention, no MLP, no KV cache; biased
    # products (its 128 channels as 2 heads of 64)
    config = tf.AutoConfig.for_model("mamba", vocab_size=common["vocab_size"], hidden_size=64, num_hidden_layers=3,
                                     state_size=16, expand=2, conv_kernel=4, time_step_rank=8, use_bias=True,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _scan_nudged(_nudged(tf.AutoModelForCausalLM.from_config(config), biases=0.2))


def _falcon_mamba(tf: Any, common: dict[str, Any]) -> Any:  # dt, B and C RMS-normed without weights; 96 channels
    # (2 heads of 48), a state of 8, 3 taps
    config = tf.AutoConfig.for_model("falcon_mamba", vocab_size=common["vocab_size"], hidden_size=48,
                                     num_hidden_layers=2, state_size=8, expand=2, conv_kernel=3, time_step_rank=6,
                                     mixer_rms_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _scan_nudged(_nudged(tf.AutoModelForCausalLM.from_config(config)))


def _jamba(tf: Any, common: dict[str, Any]) -> Any:  # Mamba-1 layers (dt, B and C normed with weights; a dt rank
    # of 32, so its product is quantized too) around attention without positions; a mixture on every other layer
    # (the Mamba ones), the others a SwiGLU MLP
    model = _auto(tf, "jamba", **{**common, "num_hidden_layers": 4}, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=0, num_experts=4, num_experts_per_tok=2,
                  mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=32, mamba_proj_bias=True)
    return _scan_nudged(_nudged(model, biases=0.2))


def _zamba2(tf: Any, common: dict[str, Any], **changes: Any) -> Any:  # Mamba-2 layers, two hybrid ones with the
    # two shared attention blocks (rotary, per-use adapters drawn off zero) on [x, the embeddings]
    import torch

    model = _auto(tf, "zamba2", **{**common, "num_hidden_layers": 4, "num_key_value_heads": 4},
                  layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=8, mamba_d_state=16,
                  mamba_ngroups=2, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
                  **{"time_step_min": 1e-9, "num_mem_blocks": 2, **changes})  # (the clamp inactive: transformers
    # clamps dt in a prompt but not in a decode step; test_parity checks the clamp on prompts)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adapter_list" in name:  # (each a fifth or so of its product's weights, after make_model's 4x)
                p.normal_(0.0, 0.03)
    return _nudged(model, dt_bias=0.5)


def _gemma4_text(tf: Any, common: dict[str, Any]) -> Any:  # sliding layers of 2 KV heads of 16, full ones of 1 KV
    # head of 32 whose keys are their values (k_eq_v) and a proportional rotary on a quarter of them; layer scalars
    import torch

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    model = _auto(tf, "gemma4_text", **{**common, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32,
                  num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8, rope_parameters=rope,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                  hidden_size_per_layer_input=0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return _nudged(model)


def _gemma4_e(tf: Any, common: dict[str, Any]) -> Any:  # Gemma 4 E2B / E4B's form: per-layer embeddings, the last
    # two layers reading the caches of the last sliding and full layers before them, with MLPs twice as wide
    import torch

    model = _auto(tf, "gemma4_text", **{**common, "num_hidden_layers": 6}, head_dim=16, global_head_dim=32,
                  sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 3,
                  hidden_size_per_layer_input=8, vocab_size_per_layer_input=common["vocab_size"],
                  num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                  hidden_activation="gelu_pytorch_tanh")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return _nudged(model)


def _gemma4_moe(tf: Any, common: dict[str, Any]) -> Any:  # Gemma 4 26B-A4B's form: a mixture of GeGLU experts
    # beside every layer's MLP, each with its own norms, the router's scale and each expert's scale drawn off one
    import torch

    model = _auto(tf, "gemma4_text", **{**common, "num_hidden_layers": 2}, head_dim=16, global_head_dim=32,
                  num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                  enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                  final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
            for norm in (layer.post_feedforward_layernorm_1, layer.post_feedforward_layernorm_2,
                         layer.pre_feedforward_layernorm_2):
                norm.weight.add_(0.3 * torch.randn_like(norm.weight))
            layer.router.scale.uniform_(0.5, 1.5)
            layer.router.per_expert_scale.uniform_(0.5, 1.5)
    return _nudged(model)


def _apertus1p5_text(tf: Any, common: dict[str, Any]) -> Any:  # Apertus's layers, a head without its last 40 rows
    import torch

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = _auto(tf, "apertus1p5_text", **common, head_dim=16, rope_parameters=rope,
                  output_vocab_size=common["vocab_size"] - 40)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.act_fn.alpha_p.normal_(0.0, 0.5)
            layer.mlp.act_fn.alpha_n.normal_(0.0, 0.5)
    return model


def _jetmoe(tf: Any, common: dict[str, Any]) -> Any:  # a mixture of attention (q and o per expert) and of MLPs
    import torch

    fields = {k: v for k, v in common.items() if k not in ("num_attention_heads", "num_key_value_heads",
                                                          "intermediate_size")}
    model = _auto(tf, "jetmoe", **fields, num_key_value_heads=2, kv_channels=16, num_local_experts=4,
                  num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False)
    with torch.no_grad():  # (its biases after each mixture start at zero)
        for layer in model.model.layers:
            layer.mlp.bias.normal_(0.0, 0.5)
            layer.self_attention.experts.bias.normal_(0.0, 0.5)
    return model


def _kolibri1_1(tf: Any, common: dict[str, Any]) -> Any:  # Kolibri-1 with indexed attention layers (NVFP4 K / V,
    # keys chosen past sink + topk + local = 2 + 6 + 4 = 12 of them), one reading another's cache, a dense first
    # layer, a pool of 192 keys (the engines' context)
    import torch

    model = _auto(tf, "kolibri1_1", **{k: v for k, v in common.items() if k not in ("intermediate_size",
                                                                                  "num_hidden_layers")},
                  num_hidden_layers=5, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, norm_topk_prob=True, sliding_window=8,
                  layer_types=["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention",
                               "sliding_attention"],  # (a layer writing its cache after the one reading another's)
                  kv_source_layers=[0, 1, 2, 1, 4], index_layers=[1], index_topk=6, index_num_local_tokens=4,
                  index_num_sink_tokens=2, index_num_heads=2, index_pool_size=192, index_compression=16,
                  mlp_only_layers=[0], mlp_only_intermediate_size=96)
    with torch.no_grad():  # a bias on the logits' scale, so that it changes the choice
        for name, t in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 2.0)
    return model


def _bitnet(tf: Any, common: dict[str, Any]) -> Any:  # norms before o and down (moved off ones), a squared-ReLU
    # gated MLP; as its bf16 master weights ship (no quantization_config)
    return _nudged(_auto(tf, "bitnet", **common, tie_word_embeddings=False))


def _as_published_bitnet(out: Path, linear_class: str = "autobitlinear", mode: str = "offline") -> None:
    """The saved BitNet model as its ternary checkpoints ship (quantization_config "bitnet"; bitnet-b1.58-2B-4T: an
    offline AutoBitLinear): each decoder product's weight rounded to -1, 0, 1 times 1 / s (s = 1 / mean |W|, BitNet's
    WeightQuant), stored as transformers' 2-bit packing with its scale in bf16 (BitLinear: s, divided by; an offline
    AutoBitLinear: 1 / s, multiplied by), or (online) the master weight itself, which the model rounds as it runs."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.integrations.bitnet import pack_weights

    weights = {}
    for key, value in load_file(str(out / "model.safetensors")).items():
        if key.startswith("model.layers.") and key.endswith("_proj.weight") and mode == "offline":
            s = 1.0 / value.abs().mean().clamp(min=1e-5)
            weights[key] = pack_weights((value * s).round().clamp(-1, 1))
            scale = s if linear_class == "bitlinear" else 1.0 / s
            weights[key.removesuffix("weight") + "weight_scale"] = scale.reshape(1).to(torch.bfloat16)
        else:
            weights[key] = value
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitnet", "linear_class": linear_class,
                                     "quantization_mode": mode}
    (out / "config.json").write_text(json.dumps(config))


TINY_BUILDERS.update({"granite_swa": _granite_swa, "granitemoe_swa": _granitemoe_swa, "hyperclovax": _hyperclovax,
                      "jais2": _jais2, "youtu": _youtu, "minicpm5_moe": _minicpm5_moe, "mellum": _mellum,
                      "flint": _flint, "hy_v3": _hy_v3, "kolibri1": _kolibri1,
                      "dbrx": _dbrx, "cohere2_moe": _cohere2_moe,
                      "phimoe": _phimoe, "llama4_text": _llama4_text,
                      **{mt: _sparse_indexed(mt) for mt in ("deepseek_v32", "glm_moe_dsa")}, "axk1": _axk1,
                      "mimo_v2_flash": _mimo_v2_flash, "laguna": _laguna, "lfm2": _lfm2,
                      "lfm2_moe": _lfm2_moe, "lfm3": _lfm3,
                      "qwen3_5_text": _qwen3_5_text, "qwen3_5_moe_text": _qwen3_5_moe_text,
                      "qwen3_next": _qwen3_next, "lara_mini": _lara_mini, "granitemoehybrid": _granitemoehybrid,
                      "granitemoehybrid_dense": _granitemoehybrid_dense, "bamba": _bamba, "nemotron_h": _nemotron_h,
                      "falcon_h1": _falcon_h1, "falcon_h1_normed": _falcon_h1_normed, "kimi_linear": _kimi_linear,
                      "olmo_hybrid": _olmo_hybrid, "nemotron_h_moe": _nemotron_h_moe,
                      "mamba2": _mamba2, "nemotron_h_latent": _nemotron_h_latent, "mamba": _mamba,
                      "falcon_mamba": _falcon_mamba, "jamba": _jamba, "zamba2": _zamba2,
                      "gemma4_text": _gemma4_text, "gemma4_e": _gemma4_e, "gemma4_moe": _gemma4_moe,
                      "apertus1p5_text": _apertus1p5_text, "jetmoe": _jetmoe,
                      "kolibri1_1": _kolibri1_1, "bitnet": _bitnet, "bitnet_ternary": _bitnet})
# arch -> how its saved folder is rewritten as checkpoints ship
PUBLISHED_AS = {"exaone": _as_published_exaone, "nemotron_h": _as_published_nemotron_h,
                "nemotron_h_moe": _as_published_nemotron_h, "nemotron_h_latent": _as_published_nemotron_h,
                "kimi_linear": _as_published_kimi_linear,
                "granitemoehybrid": _as_published_granite_hybrid, "granitemoehybrid_dense": _as_published_granite_hybrid,
                "bitnet_ternary": _as_published_bitnet}


def make_model(arch: str, out: Path, vocab_size: int = 320, seed: int = 0) -> Path:
    """Save a tiny random `arch` model (llama, llama3, mistral, qwen2, gpt2, and TINY_BUILDERS' families) with a
    tokenizer into out."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=True))
    elif arch == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False))
    elif arch == "mistral":  # a window shorter than the longer test prompts, on every layer
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=16))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
    elif arch in TINY_BUILDERS:
        model = TINY_BUILDERS[arch](tf, common)
    elif arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                            bos_token_id=1, eos_token_id=2)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    with torch.no_grad():  # random init is near-uniform; widen it so greedy paths are decisive
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    if arch in PUBLISHED_AS:
        PUBLISHED_AS[arch](out)
    make_tokenizer(out, vocab_size)
    return out
