"""Make a random BitNet b1.58 checkpoint of bitnet-b1.58-2B-4T's shapes (hidden 2560, MLP 6912, 20 query and 5 KV
heads, 128,256-token vocabulary tied to the head) with fewer layers, as the published one ships (quantization_config
"bitnet", offline AutoBitLinear: 2-bit packed ternary weights, bf16 scales), export it and build its engines, and
print the command that benchmarks them.

    python scripts/bitnet_bench.py OUT_DIR [LAYERS]      # then run the printed llmc bench command

Engines: `--quant int4` (its ternary layers on llmc's 2-bit operator, MatMulQ2: the weights as they are, 2 bits
each and a scale a column, each row's input rounded to int8 by the operator: the model's integers; fp32 cache, the
default for it) and the same on the 4-bit tiles (MatMulQ4: the ternary weights on their own 4-bit grid, the layout
before MatMulQ2), each with the head at the base precision (`--quality-target 0`: the search's one candidate is the
head, and its calibration of a model this size is most of the build).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(out: Path, layers: int) -> None:
    import torch
    import transformers as tf
    from tiny_models import _as_published_bitnet, make_tokenizer

    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.export.exporter import ExportConfig, export

    torch.manual_seed(0)
    config = tf.BitNetConfig(vocab_size=128256, hidden_size=2560, intermediate_size=6912, num_hidden_layers=layers,
                             num_attention_heads=20, num_key_value_heads=5, max_position_embeddings=4096,
                             rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf = out / "hf"
    if not (hf / "config.json").is_file():
        model = tf.BitNetForCausalLM(config)
        print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")
        model.save_pretrained(str(hf))
        del model
        _as_published_bitnet(hf)
        make_tokenizer(hf, 320)
        settings = json.loads((hf / "tokenizer_config.json").read_text())  # (the tiny models' 128-token limit off)
        (hf / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 4096}))
    if not (out / "export" / "llmc.json").is_file():
        export(ExportConfig(str(hf), out / "export", force=True))
    fast = {"quality_target": 0.0, "allow_divergence": True}  # (a random model's flat logits: its greedy answer may part)
    build_ort(BuildConfig(out / "export", out / "int4", quant="int4", force=True, **fast))
    from llmc.graph import quant

    quant.ternary_columns = lambda w, axis=0: False  # type: ignore[assignment]  # (the ternary layers on MatMulQ4)
    build_ort(BuildConfig(out / "export", out / "int4-q4", quant="int4", force=True, **fast))
    print(f"llmc bench {out}/int4 --against {out}/int4-q4 --batch-sizes 1,8 --prompt-len 128 --new-tokens 64 "
          "--repeat 3")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/bitnet"), int(sys.argv[2]) if len(sys.argv) > 2 else 8)
