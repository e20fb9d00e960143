"""Tiny random-weight models of each supported architecture, with a real byte-level BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

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


def make_model(arch: str, out: Path, vocab_size: int = 320, seed: int = 0) -> Path:
    """Save a tiny random `arch` model (llama, llama3, mistral, qwen2, gpt2) with a tokenizer into out."""
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
    elif arch == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
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
    make_tokenizer(out, vocab_size)
    return out
