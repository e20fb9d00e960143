"""What `llmc export` and `llmc build --quant int4` hold in memory, and how long they take, on a model of Qwen2.5-1.5B's
shapes (hidden 1,536, MLP 8,960, 12 query and 2 KV heads, 151,936-token vocabulary tied to the head) with LAYERS of
its 28 layers (6: 0.5 B parameters; 28: the whole 1.5 B), or of Qwen2.5-0.5B's (SHAPES 0.5b: hidden 896, MLP 4,864,
14 query and 2 KV heads, 24 layers), random weights. Each stage runs as its own process; its peak resident memory
(VmHWM: the export's weights file mapped counts there too, page cache the kernel can take back) and its peak
anonymous memory (RssAnon, sampled every 0.1 s: the process's own) are printed.

    python scripts/build_memory.py OUT_DIR [LAYERS [SHAPES]]      # needs the export extra (torch, transformers)

The build is `--allow-divergence`: a random model's flat logits part from its greedy answer at 4 bits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


SHAPES = {"1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12),
          "0.5b": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14)}


def make_model(hf: Path, layers: int, shapes: str = "1.5b") -> None:
    import torch
    import transformers as tf
    from tiny_models import make_tokenizer

    torch.manual_seed(0)
    config = tf.Qwen2Config(vocab_size=151936, num_hidden_layers=layers, **SHAPES[shapes], num_key_value_heads=2,
                            max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    model = tf.Qwen2ForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
    model.save_pretrained(str(hf))
    del model
    make_tokenizer(hf, 320)
    settings = json.loads((hf / "tokenizer_config.json").read_text())  # (the tiny models' 128-token limit off)
    (hf / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 4096}))


def measured(args: list[str]) -> None:
    """Run `llmc ARGS`, printing its peak resident and peak anonymous memory and its time."""
    start = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", "llmc.cli.main", *args])
    anon = hwm = 0
    while child.poll() is None:
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{child.pid}/status").read_text().splitlines())
            anon = max(anon, int(fields["RssAnon"].split()[0]))
            hwm = max(hwm, int(fields["VmHWM"].split()[0]))
        except (OSError, KeyError, ValueError):  # (the process ending between the poll and the read)
            pass
        time.sleep(0.1)
    if child.returncode:
        sys.exit(f"llmc {' '.join(args)} exited {child.returncode}")
    print(f"llmc {args[0]}: peak RSS {hwm / 1e6:.2f} GB, peak anonymous {anon / 1e6:.2f} GB, "
          f"{time.monotonic() - start:.0f} s", flush=True)


def main(out: Path, layers: int, shapes: str) -> None:
    hf = out / "hf"
    if not (hf / "config.json").is_file():
        make_model(hf, layers, shapes)
    measured(["export", str(hf), "-o", str(out / "export"), "--force"])
    measured(["build", str(out / "export"), "-o", str(out / "int4"), "--quant", "int4", "--force",
              "--allow-divergence"])


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out/memory"), int(sys.argv[2]) if len(sys.argv) > 2 else 6,
         sys.argv[3] if len(sys.argv) > 3 else "1.5b")
