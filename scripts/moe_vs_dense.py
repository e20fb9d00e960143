"""Make a random mixture-of-experts model and a dense one with the same active parameters per token, export and
build both, and print the command that benchmarks them side by side (`llmc bench MOE --against DENSE`).

    python scripts/moe_vs_dense.py OUT_DIR        # then run the printed llmc bench command

MoE: Mixtral-style, 8 experts, 2 per token, expert width 1024; dense: a Llama with the same attention and an MLP of
width 2048, so each token runs the same number of MLP parameters (2 x 3 x 512 x 1024) in both.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(out: Path) -> None:
    import torch
    import transformers as tf
    from tiny_models import make_tokenizer

    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.export.exporter import ExportConfig, export

    common = dict(vocab_size=320, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    models = {"moe": tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=1024, num_local_experts=8,
                                                             num_experts_per_tok=2, sliding_window=None)),
              "dense": tf.LlamaForCausalLM(tf.LlamaConfig(**common, intermediate_size=2048))}
    for name, model in models.items():
        torch.manual_seed(0)
        hf = out / name / "hf"
        model.save_pretrained(str(hf))
        make_tokenizer(hf, 320)
        export(ExportConfig(str(hf), out / name / "export", force=True))
        build_ort(BuildConfig(out / name / "export", out / name / "engine", force=True))
        active = sum(p.numel() for n, p in model.named_parameters() if "experts" not in n)
        if name == "moe":
            active += sum(p.numel() for n, p in model.named_parameters() if "experts" in n) * 2 // 8
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
              f"{active / 1e6:.1f} M active per token")
    print(f"llmc bench {out}/moe/engine --against {out}/dense/engine --batch-sizes 1,8 --prompt-len 128 "
          "--new-tokens 64 --repeat 3")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/moe-vs-dense"))
