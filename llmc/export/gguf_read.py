"""GGUF files read as llama.cpp's converter (`convert_hf_to_gguf.py`) writes them and llama.cpp reads them, where
transformers' GGUF reader (which llmc's GGUF route otherwise uses) reads another model or none.

transformers reads a GGUF file's config from a table of metadata keys and its tensors by mapping the model's own
parameter names through gguf's name table. It reads no rotary scaling at all: a Llama 3.x file (its llama3 scaling
written only as the `rope_freqs` divisors), a Gemma 3 4B-27B file (linear 8 on its full layers), a yarn Qwen or a
longrope Phi-3 would load as another model, as would Gemma 2 / 3 27B (their query scale is not the head size) and
Phi-4-mini (three quarters of each head rotated). `transformers_config` and `apply_rope_freqs` put those back for
the families transformers reads. For two families people deploy from GGUF it falls short entirely:

- **Gemma 4** (`Gemma4Model`): per-layer KV head counts and feed-forward widths (arrays in the file: 31B, 26B-A4B,
  E2B / E4B) fail transformers' config validation; the sliding layers' head size (`attention.key_length_swa`), the
  layer pattern (`attention.sliding_window_pattern`), the KV-shared layers, the per-layer embeddings' width, the
  mixture's sizes, keys-as-values (no `attn_v` on the full layers) and the full layers' rotary fraction (the
  `rope_freqs` tensor: 1 for a rotated pair) are not read at all, so the class defaults would stand in for them;
  each layer's scalar (`layer_output_scale.weight`), the stacked experts and the router's two `.scale` tensors carry
  names transformers' map does not look for.
- **gpt-oss** (`GptOssModel`): transformers parses the file's yarn keys wrongly and stops (and would rotate with
  yarn's truncation, which gpt-oss does not use); the experts are stored transposed with gate and up split
  (`ffn_gate_exps`, `ffn_up_exps`, their biases too), the sinks as `attn_sinks.weight`, none of which its map finds.

`load_model` builds the config from the file's keys (`config_for`), the model from it, and reads every weight from
the file itself. What a file does not say (Gemma 4's activation, gpt-oss's SwiGLU limit, layer pattern and yarn
without truncation) is the family's as every checkpoint has it.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from llmc.errors import InputError, UnsupportedModelError, one_line

GEMMA4 = "gemma4"
GPT_OSS = "gpt-oss"


@functools.lru_cache(maxsize=1)
def _reader_of(path: str, stamp: tuple[int, int]) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def open_file(path: Path) -> Any:
    """The file's gguf reader, parsed once for the export's several readings of it (its metadata's parse takes
    ~2 s for SmolLM2's 49 k tokens and merges; the arrays stay memory-mapped)."""
    stat = path.stat()
    return _reader_of(str(path), (stat.st_mtime_ns, stat.st_size))


def architecture(reader: Any) -> str:
    """`general.architecture`: the file's family as llama.cpp names it."""
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _fields(reader: Any, arch: str) -> dict[str, Any]:
    """The file's `arch.*` metadata by key without the prefix: ints, floats, bools, strings, or lists of them."""
    import gguf

    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not key.startswith(arch + "."):
            continue
        types = list(field.types)
        values: list[Any] = []
        for i in field.data:
            part = field.parts[i]
            kind = types[-1]
            if kind == gguf.GGUFValueType.STRING:
                values.append(bytes(part).decode())
            elif kind == gguf.GGUFValueType.BOOL:
                values.append(bool(part[0]))
            elif kind in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
                values.append(float(part[0]))
            else:
                values.append(int(part[0]))
        out[key[len(arch) + 1:]] = values if types[0] == gguf.GGUFValueType.ARRAY else values[0]
    return out


def _per_layer(value: Any, n: int, key: str, path: Path) -> list[Any]:
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise UnsupportedModelError(f"{path}: {key} has {len(value)} values for {n} layers")
    return value


def _one(values: list[Any], key: str, what: str, path: Path) -> Any:
    if len(set(values)) != 1:
        raise UnsupportedModelError(f"{path}: {key} differs between {what} ({sorted(set(values))}); transformers' "
                                    f"Gemma 4 takes one value for them")
    return values[0]


def _gemma4_config(reader: Any, path: Path) -> Any:
    from transformers import Gemma4TextConfig

    f = _fields(reader, GEMMA4)
    tensors = {t.name: t for t in reader.tensors}
    n = int(f["block_count"])
    if "attention.sliding_window_pattern" not in f:
        raise UnsupportedModelError(f"{path}: a Gemma 4 GGUF without {GEMMA4}.attention.sliding_window_pattern "
                                    "(which layers slide): llama.cpp's converter writes it")
    sliding = _per_layer(f["attention.sliding_window_pattern"], n, "attention.sliding_window_pattern", path)
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    full = [i for i in range(n) if not sliding[i]]
    local = [i for i in range(n) if sliding[i]]
    if not full or not local or not sliding or sliding[-1]:
        raise UnsupportedModelError(f"{path}: {GEMMA4}.attention.sliding_window_pattern {sliding} is not Gemma 4's "
                                    "(sliding and full layers, the last one full)")
    shared = int(f.get("attention.shared_kv_layers", 0))
    kv = _per_layer(f["attention.head_count_kv"], n, "attention.head_count_kv", path)
    ff = _per_layer(f["feed_forward_length"], n, "feed_forward_length", path)
    own = [i for i in full if i < n - shared]  # full layers with keys of their own
    k_eq_v = bool(own) and all(f"blk.{i}.attn_v.weight" not in tensors for i in own)
    kv_local = _one([kv[i] for i in local], "attention.head_count_kv", "sliding layers", path)
    kv_full = _one([kv[i] for i in full], "attention.head_count_kv", "full layers", path)
    if kv_full != kv_local and not k_eq_v:
        raise UnsupportedModelError(f"{path}: full layers of {kv_full} KV heads beside sliding ones of {kv_local}, "
                                    "with values of their own: transformers' Gemma 4 has such heads only where keys "
                                    "are the values")
    width = int(ff[0])
    if any(int(v) != width for v in ff[:n - shared]) or any(int(v) not in (width, 2 * width) for v in ff[n - shared:]) \
            or len({int(v) for v in ff[n - shared:]}) > 1:
        raise UnsupportedModelError(f"{path}: {GEMMA4}.feed_forward_length {ff} is not one width (twice it on the "
                                    "KV-shared layers)")
    freqs = tensors.get("rope_freqs.weight")
    if freqs is None:
        raise UnsupportedModelError(f"{path}: a Gemma 4 GGUF without rope_freqs.weight (the full layers' rotary "
                                    "fraction): llama.cpp's converter writes it")
    head, head_local = int(f["attention.key_length"]), int(f["attention.key_length_swa"])
    rotated = int((np.asarray(freqs.data) == 1.0).sum())
    local_rot = int(f.get("rope.dimension_count_swa", head_local))
    sliding_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(f.get("rope.freq_base_swa", 10_000.0))}
    if local_rot != head_local:
        sliding_rope["partial_rotary_factor"] = local_rot / head_local
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    per_layer = int(f.get("embedding_length_per_layer_input", 0))
    config: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=int(f["embedding_length"]), num_hidden_layers=n, intermediate_size=width,
        use_double_wide_mlp=shared > 0 and int(ff[-1]) == 2 * width, num_attention_heads=int(f["attention.head_count"]),
        num_key_value_heads=int(kv_local), num_global_key_value_heads=int(kv_full) if k_eq_v else None,
        head_dim=head_local, global_head_dim=head, attention_k_eq_v=k_eq_v, layer_types=types,
        sliding_window=int(f["attention.sliding_window"]), rms_norm_eps=float(f["attention.layer_norm_rms_epsilon"]),
        final_logit_softcapping=f.get("final_logit_softcapping"), num_kv_shared_layers=shared,
        hidden_size_per_layer_input=per_layer, max_position_embeddings=int(f["context_length"]),
        tie_word_embeddings="output.weight" not in tensors,
        rope_parameters={"sliding_attention": sliding_rope,
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / head,
                                            "rope_theta": float(f.get("rope.freq_base", 1_000_000.0))}},
        **_special_ids(reader, ("<turn|>", "<|tool_response>")))
    if per_layer:
        table = tensors.get("per_layer_token_embd.weight")
        if table is None:
            raise UnsupportedModelError(f"{path}: per-layer embeddings {per_layer} wide without "
                                        "per_layer_token_embd.weight")
        config["vocab_size_per_layer_input"] = int(table.shape[-1])  # (GGUF's dims run innermost first)
    if f.get("expert_count"):
        config.update(enable_moe_block=True, num_experts=int(f["expert_count"]),
                      top_k_experts=int(f["expert_used_count"]),
                      moe_intermediate_size=int(f["expert_feed_forward_length"]))
    return Gemma4TextConfig(**config)


# what llama.cpp ends a generation at (llama-vocab.cpp): the tokens the file names (EOS, end of turn, end of message;
# the fill-in-the-middle pad, repository and file separators), those of these texts where the vocabulary has them,
# and harmony's <|end|> left out where <|return|> and <|call|> are both there (gpt-oss ends a message with it)
_END_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
_END_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
              "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")
_FIM_TEXTS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
              "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
              "fim_sep": ("<|file_sep|>",)}


def _token_id(reader: Any, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.parts[field.data[0]][0])


def end_of_generation(reader: Any, ends: tuple[str, ...] = ()) -> list[int]:
    """The token ids a generation ends at, as llama.cpp takes them from a GGUF file (which holds no generation
    config: transformers' reader keeps its EOS alone, so a Llama 3 file whose EOS is <|end_of_text|> would run on
    past <|eot_id|>): EOS first, then `ends` (a family's other ends, by their text) and llama.cpp's."""
    tokens = reader.fields["tokenizer.ggml.tokens"]
    text = {bytes(tokens.parts[i]).decode(errors="replace"): k for k, i in enumerate(tokens.data)}
    named = {key: _token_id(reader, f"tokenizer.ggml.{key}_token_id") for key in _END_KEYS}
    for key, texts in _FIM_TEXTS.items():
        if named[key] is None:
            named[key] = next((text[t] for t in texts if t in text), None)
    ids = [named["eos"], *(text.get(t) for t in ends), *named.values(), *(text.get(t) for t in _END_TEXTS)]
    out = list(dict.fromkeys(i for i in ids if i is not None and 0 <= i < len(tokens.data)))
    if "<|return|>" in text and "<|call|>" in text and text.get("<|end|>") in out:
        out.remove(text["<|end|>"])
    return out


def _special_ids(reader: Any, ends: tuple[str, ...]) -> dict[str, Any]:
    """BOS, pad and every end of generation (`end_of_generation`, with the family's other `ends`, as the
    checkpoints' generation configs list them)."""
    out: dict[str, Any] = {"eos_token_id": end_of_generation(reader, ends) or None}
    for name, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if (value := _token_id(reader, key)) is not None:
            out[name] = value
    return out


def _gpt_oss_config(reader: Any, path: Path) -> Any:
    from transformers import GptOssConfig

    f = _fields(reader, GPT_OSS)
    scaling = f.get("rope.scaling.type", "none")
    if scaling != "yarn":
        raise UnsupportedModelError(f"{path}: {GPT_OSS}.rope.scaling.type {scaling!r}: gpt-oss rotates with yarn")
    rope = {"rope_type": "yarn", "rope_theta": float(f["rope.freq_base"]), "factor": float(f["rope.scaling.factor"]),
            "original_max_position_embeddings": int(f["rope.scaling.original_context_length"]),
            "beta_fast": float(f.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(f.get("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    tensors = {t.name for t in reader.tensors}
    return GptOssConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data), hidden_size=int(f["embedding_length"]),
        num_hidden_layers=int(f["block_count"]), intermediate_size=int(f["expert_feed_forward_length"]),
        num_attention_heads=int(f["attention.head_count"]), num_key_value_heads=int(f["attention.head_count_kv"]),
        head_dim=int(f["attention.key_length"]), num_local_experts=int(f["expert_count"]),
        num_experts_per_tok=int(f["expert_used_count"]), sliding_window=int(f["attention.sliding_window"]),
        rms_norm_eps=float(f["attention.layer_norm_rms_epsilon"]), max_position_embeddings=int(f["context_length"]),
        tie_word_embeddings="output.weight" not in tensors, rope_parameters=rope,
        **_special_ids(reader, ("<|return|>", "<|call|>")))


def _gemma4_names(key: str, names: Any) -> list[str]:
    """Where a Gemma 4 parameter may be in the file: gguf's name table (a scalar or a stack of experts under a
    `.weight` name, as the converter renames them), the router's two scales as `.scale` tensors."""
    parts = key.split(".")
    if len(parts) >= 4 and parts[1] == "layers":
        if key.endswith(".router.scale"):
            return [f"blk.{parts[2]}.ffn_gate_inp.scale"]
        if key.endswith(".router.per_expert_scale"):
            return [f"blk.{parts[2]}.ffn_down_exps.scale"]
    found = (names.get_name(key, try_suffixes=(".weight", ".bias")), names.get_name(key + ".weight",
                                                                                   try_suffixes=(".weight",)))
    return [n for n in found if n]


def _gpt_oss_values(key: str, read: Any) -> np.ndarray | None:
    """A gpt-oss layer's experts and sinks from the file: its gate and up rows interleaved back into columns (and
    biases), its down rows transposed back."""
    parts = key.split(".")
    if len(parts) < 4 or parts[1] != "layers":
        return None
    blk = f"blk.{parts[2]}"
    if key.endswith("experts.gate_up_proj") or key.endswith("experts.gate_up_proj_bias"):
        kind = "bias" if key.endswith("_bias") else "weight"
        gate, up = read(f"{blk}.ffn_gate_exps.{kind}"), read(f"{blk}.ffn_up_exps.{kind}")
        if gate is None or up is None or gate.shape != up.shape:
            return None
        if kind == "weight":  # [E, I, H] rows -> [E, H, 2I] columns
            gate, up = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        both = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],), dtype=np.float32)
        both[..., ::2], both[..., 1::2] = gate, up
        return both
    if key.endswith("experts.down_proj"):
        rows = read(f"{blk}.ffn_down_exps.weight")
        return None if rows is None else rows.transpose(0, 2, 1)
    if key.endswith("experts.down_proj_bias"):
        return read(f"{blk}.ffn_down_exps.bias")
    if key.endswith("self_attn.sinks"):
        return read(f"{blk}.attn_sinks.weight")
    return None


@dataclass
class GGUFFile:
    """A GGUF file as llmc's reader sees it: its `arch.*` keys (without the prefix), its tensors by name, and which
    of them have been read (every one must be: `load_model`)."""

    path: Path
    reader: Any
    arch: str
    keys: dict[str, Any]
    tensors: dict[str, Any]
    used: set[str] = dataclass_field(default_factory=set)

    @classmethod
    def open(cls, path: Path) -> GGUFFile:
        reader = open_file(path)
        arch = architecture(reader)
        return cls(path, reader, arch, _fields(reader, arch), {t.name: t for t in reader.tensors})

    @functools.cached_property
    def names(self) -> Any:
        """gguf's name table of the file's architecture (or the one its family follows, where gguf's package has
        none for it: `Family.table`): a transformers parameter's name -> the file's."""
        import gguf

        family = families().get(self.arch)
        table = family.table if family is not None and family.table else self.arch
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == table)
        return gguf.get_tensor_name_map(arch, int(self.keys["block_count"]))

    def layers(self) -> int:
        """The layers the model runs: `block_count` less the multi-token-prediction blocks the converter appends
        (`nextn_predict_layers`), which llama.cpp loads and never runs."""
        n, nextn = int(self.keys["block_count"]), int(self.keys.get("nextn_predict_layers", 0) or 0)
        if not 0 <= nextn < n:
            raise UnsupportedModelError(f"{self.path}: {self.arch}.nextn_predict_layers {nextn} of {n} blocks")
        return n - nextn

    def per_layer(self, key: str, n: int, default: Any = None) -> list[int]:
        """A key llama.cpp reads per layer (`get_key_or_arr`): an array's first `n` values, or a scalar for every
        layer (`default` where the file has none; neither: a KeyError, as for any key a converter always writes)."""
        value = self.keys.get(key, default)
        if value is None:
            raise KeyError(key)
        values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * n
        if len(values) < n:
            raise UnsupportedModelError(f"{self.path}: {self.arch}.{key} has {len(values)} values for {n} layers")
        return values[:n]

    def named(self, key: str) -> np.ndarray | None:
        """A transformers parameter's values under the name gguf's table gives it; None if not there."""
        return self.read(self.names.get_name(key, try_suffixes=(".weight", ".bias")))

    def read(self, name: str | None) -> np.ndarray | None:
        """A tensor's values as fp32 in numpy's order of dims (GGUF's run innermost first); None if not there."""
        from gguf.quants import dequantize

        t = self.tensors.get(name) if name else None
        if t is None:
            return None
        self.used.add(t.name)
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            tuple(int(d) for d in reversed(t.shape)))


@dataclass(frozen=True)
class Family:
    """A GGUF architecture llmc reads itself: llama.cpp's name for it (`general.architecture`), transformers'
    model_type, a name for messages, the transformers config its keys make, and where its weights differ from
    gguf's name table as they are: `values` gives a parameter's values (None: by the name table), `names` where a
    parameter may be in the file (default: the name table's name). `rope_freqs`: a `rope_freqs` tensor divides the
    rotary frequencies (Llama 3's scaling), as for the families transformers reads. `table`: the architecture whose
    name table the file follows, for an architecture newer than gguf's package."""

    arch: str
    model_type: str
    title: str
    config: Callable[[GGUFFile], Any]
    values: Callable[[str, GGUFFile, Any], np.ndarray | None] | None = None
    names: Callable[[str, Any], list[str]] | None = None
    rope_freqs: bool = True
    table: str = ""  # the architecture whose gguf name table the file's tensors follow ("": its own)


def _own_families() -> tuple[Family, ...]:
    return (Family(GEMMA4, "gemma4_text", "Gemma 4", lambda g: _gemma4_config(g.reader, g.path),
                   names=_gemma4_names, rope_freqs=False),
            Family(GPT_OSS, "gpt_oss", "gpt-oss", lambda g: _gpt_oss_config(g.reader, g.path),
                   values=lambda key, g, config: _gpt_oss_values(key, g.read)))


@functools.cache
def families() -> dict[str, Family]:
    """The families llmc reads itself, by llama.cpp's architecture name (gguf_archs' modules, Gemma 4, gpt-oss)."""
    from llmc.export import gguf_archs

    return {f.arch: f for f in (*_own_families(), *gguf_archs.families())}


def model_type_of(arch: str) -> str | None:
    """The model_type of a GGUF architecture llmc reads itself (None: not one)."""
    family = families().get(arch)
    return None if family is None else family.model_type


def reads_itself(path: Path) -> bool:
    """Whether llmc reads this GGUF file itself (its architecture is one of `families`), not transformers."""
    return architecture(open_file(path)) in families()


def config_for(path: Path) -> Any | None:
    """The transformers config of a GGUF file of a family llmc reads itself (None: transformers' reader's)."""
    family = families().get(architecture(open_file(path)))
    if family is None:
        return None
    try:
        return family.config(GGUFFile.open(path))
    except KeyError as e:  # a key every file of llama.cpp's converter has
        key = str(e.args[0])
        raise InputError(f"{path}: a {family.title} GGUF without "
                         f"{key if key.startswith(('tokenizer.', family.arch + '.')) else family.arch + '.' + key}") \
            from None


def text_config(g: GGUFFile, model_type: str, **fields: Any) -> Any:
    """The transformers config of `model_type` from the keys every converter's `TextModel` writes (the widths and
    counts, the context, the head size, the norms' epsilon, the window, the rotary base, scaling and rotated share,
    the vocabulary, BOS / pad and every end of generation, a tied head where the file has no `output.weight`), each
    set where the config class has the field; `fields` (the family's own) over them."""
    from transformers import AutoConfig

    k = g.keys
    base = AutoConfig.for_model(model_type)
    tokens = g.reader.fields.get("tokenizer.ggml.tokens")
    table = g.tensors.get("token_embd.weight")  # (its rows: the vocabulary the model has, padded or not)
    found: dict[str, Any] = {
        "vocab_size": int(table.shape[-1]) if table is not None else k.get(
            "vocab_size", len(tokens.data) if tokens is not None else None),
        "hidden_size": k["embedding_length"], "num_hidden_layers": k["block_count"],
        "intermediate_size": k.get("feed_forward_length"), "num_attention_heads": k["attention.head_count"],
        "num_key_value_heads": k.get("attention.head_count_kv"), "max_position_embeddings": k.get("context_length"),
        "head_dim": k.get("attention.key_length"), "rms_norm_eps": k.get("attention.layer_norm_rms_epsilon"),
        "layer_norm_eps": k.get("attention.layer_norm_epsilon"), "sliding_window": k.get("attention.sliding_window"),
        "tie_word_embeddings": "output.weight" not in g.tensors}
    kwargs = {name: value for name, value in found.items() if value is not None and hasattr(base, name)}
    kwargs.update(_special_ids(g.reader, ()))
    theirs = dict(getattr(base, "rope_parameters", None) or {})
    if theirs and "full_attention" not in theirs and "rope_parameters" not in fields:  # (or the family's own)
        theta = k.get("rope.freq_base", 10000.0)  # (llama.cpp's where the file has none, not the class's)
        rope = {**theirs, "rope_type": "default", "rope_theta": float(theta)}
        for drop in ("factor", "original_max_position_embeddings", "partial_rotary_factor"):
            rope.pop(drop, None)
        rope.update(_scaled_rope(k, g.tensors, g.path, g.arch))
        head = int(kwargs.get("head_dim") or int(k["embedding_length"]) // int(k["attention.head_count"]))
        if "rope.dimension_count" in k and int(k["rope.dimension_count"]) != head:
            rope["partial_rotary_factor"] = int(k["rope.dimension_count"]) / head
        kwargs["rope_parameters"] = rope
    kwargs.update(fields)
    return AutoConfig.for_model(model_type, **kwargs)


def text_sections(g: GGUFFile, rotated: int) -> bool:
    """Whether the file rotates by a multimodal rotary's sections (`rope.dimension_sections`: a vision-language
    model's text half), checked to turn text as one rotary: a text token takes the same position in each of the first
    three sections (llama.cpp puts it there), and the sections only choose whose position a frequency turns by, so
    sections covering the `rotated` dims' pairs with those three are the plain rotary; a 4th with dims is refused."""
    sections = [int(s) for s in g.keys.get("rope.dimension_sections") or []]
    if not any(sections):
        return False
    if sum(sections[:3]) != rotated // 2 or any(sections[3:]):
        raise UnsupportedModelError(f"{g.path}: {g.arch}.rope.dimension_sections {sections}: not three sections of "
                                    f"the {rotated // 2} rotated pairs, so a text token would not turn as by one "
                                    "rotary")
    return True


def rotated_share(g: GGUFFile, head: int, title: str, key: str = "rope.dimension_count") -> float:
    """The share of each head rotated (`key`; `rope.dimension_count` where a `_swa` key is absent, the whole head
    where that is), refused where transformers' `title` class cannot rotate it (odd, past the head, or not a share
    it rounds back to)."""
    rotated = int(g.keys.get(key, g.keys.get("rope.dimension_count", head)))
    factor = rotated / head
    if rotated > head or rotated % 2 or int(head * factor) != rotated:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.{key} {rotated} of a head of {head}: "
                                    f"transformers' {title} cannot rotate that share")
    return factor


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's reordering of a q / k product's rows (or bias) for its rotary (the converter's
    `LlamaModel.permute`: each head's two rotary halves interleaved)."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


_BLOCK = re.compile(r"blk\.(\d+)\.")


def _next_token(g: GGUFFile, name: str) -> bool:
    """Whether a tensor is one of the multi-token-prediction blocks the converter appends (the last
    `nextn_predict_layers` of `block_count`: GLM-4.5's, Nemotron-H's), which llama.cpp loads and never runs, as
    transformers drops a checkpoint's: no model here has a place for them."""
    block = _BLOCK.match(name)
    return block is not None and int(block.group(1)) >= g.layers()


def load_model(path: Path, attention: str | None) -> tuple[Any, dict[str, Any]] | None:
    """The fp32 transformers model of a GGUF file of a family llmc reads itself, every weight read from the file
    here (None: transformers reads this family itself), and the weights the file does not hold (as transformers'
    loading info names them). A file holding tensors the model has no place for is refused naming them.

    transformers' own loader is not called: it does not read these families, or reads them wrongly (it parses a
    gpt-oss file's yarn keys wrongly and stops; a Gemma 4 file's config fails its validation)."""
    config = config_for(path)
    if config is None:
        return None
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    family = families()[architecture(open_file(path))]
    try:
        with no_init_weights():  # (every weight is read below; buffers computed from the config are kept)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                     **({"attn_implementation": attention} if attention else {}))
    except Exception as e:  # a value transformers cannot build the model from
        raise InputError(f"transformers cannot build the model of {path} ({type(e).__name__}: {one_line(e)})") \
            from None
    g = GGUFFile.open(path)
    held = model.state_dict(keep_vars=True)
    missing, mismatched = set(), []
    for key, target in held.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # (the embeddings, tied)
        values = family.values(key, g, config) if family.values else None
        if values is None:
            where = family.names(key, g.names) if family.names else [g.names.get_name(key, try_suffixes=(
                ".weight", ".bias"))]
            values = g.read(next((n for n in where if n in g.tensors), None))
        if values is None:
            missing.add(key)
            continue
        shape = tuple(target.shape)
        if values.size != target.numel() or (values.ndim > 1 and values.shape != shape):  # (a scalar: [] or [1])
            mismatched.append((key, values.shape, shape))
            continue
        with torch.no_grad():
            target.copy_(torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape)))
    model.tie_weights()
    unread = [n for n in g.tensors if n not in g.used and n not in _READ_BY_LLMC and not _next_token(g, n)]
    if unread and not (missing or mismatched):  # (a file of another layout: the missing weights say more)
        shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        raise UnsupportedModelError(f"{path}: the {family.title} model has no place for {len(unread)} of the file's "
                                    f"tensors ({shown})")
    if family.rope_freqs:
        apply_rope_freqs(model, path)
    return model.eval(), {"missing_keys": missing, "mismatched_keys": mismatched}


# ---------------------------------------------------------------- families transformers reads, corrected

# llama.cpp's Gemma 2 / 3 scale the queries by n_embd / n_head at 27B (told by the layer count), by the head size
# otherwise; the files carry neither query_pre_attn_scalar nor the size (llama-model.cpp)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def plain_scaling(g: GGUFFile, title: str) -> str:
    """The file's rotary scaling (`rope.scaling.type`), refused unless none, linear or yarn, or with a factor on
    yarn's magnitude (`rope.scaling.attn_factor`, which llama.cpp multiplies in): transformers' `title` takes one
    attention factor."""
    k = g.keys
    kind = str(k.get("rope.scaling.type", "none"))
    if kind not in ("none", "linear", "yarn"):
        raise UnsupportedModelError(f"{g.path}: {g.arch}.rope.scaling.type {kind!r}: llmc reads llama.cpp's {title} "
                                    "with none, linear or yarn scaling")
    if float(k.get("rope.scaling.attn_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{g.path}: {g.arch}.rope.scaling.attn_factor {k['rope.scaling.attn_factor']!r}: "
                                    f"llama.cpp's {title} scales its rotary by it beside yarn's magnitude; "
                                    f"transformers' {title} takes one attention factor")
    return kind


def unread_yarn(g: GGUFFile, title: str) -> dict[str, Any]:
    """The file's keys for `_scaled_rope` where llama.cpp's `title` reads no `rope.scaling.yarn_*` key and no
    `rope.scaling.attn_factor` (OLMo 2 / 3, Laguna, Mellum): its scaling none, linear or yarn, yarn's betas 32 / 1
    and its magnitude 0.1 ln(factor) + 1 whatever the file says. A file saying otherwise (a checkpoint's own
    attention factor, say) is refused, as transformers' class would take it; the keys checked are dropped."""
    k = g.keys
    keys = dict(k)
    if plain_scaling(g, title) == "yarn":
        factor = float(k["rope.scaling.factor"])
        taken = {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0,  # (llama-hparams.h's defaults, which stand)
                 "yarn_attn_factor": 0.1 * math.log(factor) + 1.0 if factor > 1.0 else 1.0}  # (get_mscale)
        for knob, own in taken.items():
            key = f"rope.scaling.{knob}"
            if key in k and not math.isclose(float(k[key]), own, rel_tol=1e-6):
                raise UnsupportedModelError(f"{g.path}: {g.arch}.{key} {k[key]!r}: llama.cpp's {title} does not "
                                            f"read it: its yarn takes {own:.6g}, transformers' would take the file's")
            keys.pop(key, None)
    return keys


def _scaled_rope(f: dict[str, Any], tensors: dict[str, Any], path: Path, arch: str) -> dict[str, Any]:
    """The rotary scaling the file's `rope.scaling.*` keys (and longrope's factor tensors) describe, as
    transformers' rope_parameters; {} for none."""
    kind = f.get("rope.scaling.type", "none")
    key = f"{arch}.rope.scaling"
    if kind == "none" and "rope_factors_long.weight" in tensors:  # (Phi-3's converter writes longrope's factors
        kind = "longrope"  # and attention factor, not its type)
    if kind == "none":
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(f["rope.scaling.factor"])}
    if kind == "yarn":
        for knob, default in (("yarn_ext_factor", -1.0), ("yarn_attn_factor", 1.0), ("yarn_log_multiplier", 0.0)):
            if float(f.get(f"rope.scaling.{knob}", default)) != default:
                raise UnsupportedModelError(f"{path}: {key}.{knob} {f[f'rope.scaling.{knob}']}: llmc reads yarn's "
                                            "factor, original context and betas only")
        return {"rope_type": "yarn", "factor": float(f["rope.scaling.factor"]),
                "original_max_position_embeddings": int(f["rope.scaling.original_context_length"]),
                "beta_fast": float(f.get("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(f.get("rope.scaling.yarn_beta_slow", 1.0))}
    if kind == "longrope":
        long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
        if long is None or short is None:
            raise UnsupportedModelError(f"{path}: longrope without rope_factors_long / rope_factors_short")
        params: dict[str, Any] = {
            "rope_type": "longrope", "long_factor": [float(x) for x in np.asarray(long.data).ravel()],
            "short_factor": [float(x) for x in np.asarray(short.data).ravel()],
            "original_max_position_embeddings": int(f.get("rope.scaling.original_context_length",
                                                          f["context_length"]))}  # (llama.cpp's default)
        if "rope.scaling.attn_factor" in f:
            params["attention_factor"] = float(f["rope.scaling.attn_factor"])
        return params
    raise UnsupportedModelError(f"{path}: {key}.type {kind!r}: llmc reads linear, yarn and longrope scaling")


# a config's bias flags and the tensors that show them (Llama's and Nemotron's optional ones, Qwen3's; Mamba's
# projections', StarCoder2's every product's): transformers' tables read none
_ATTENTION, _MLP = ("attn_q", "attn_k", "attn_v", "attn_output"), ("ffn_gate", "ffn_up", "ffn_down")
_BIASES = {"attention_bias": _ATTENTION, "mlp_bias": _MLP, "use_bias": ("ssm_in", "ssm_out", *_ATTENTION, *_MLP)}
_FALCON_BIASES = ("attn_qkv.bias", "attn_output.bias", "ffn_up.bias", "ffn_down.bias")


def _falcon_config(config: Any, f: dict[str, Any], tensors: dict[str, Any], path: Path) -> None:
    """A Falcon file's model as llama.cpp builds it (src/models/falcon.cpp), which transformers' reader does not
    read: its keys give neither the layer norms' epsilon (`attention.layer_norm_epsilon`) nor the MLP's width
    (`feed_forward_length`: FalconConfig's is ffn_hidden_size), and it takes every file as Falcon-7B's form (one
    KV head, one norm) and its head as tied. llama.cpp runs attention and MLP side by side off `attn_norm`, the
    attention off `attn_norm_2` where a layer has one (40B / 180B), with `attention.head_count_kv` KV heads and
    no linear biases; its head is `output` where the file has one."""
    biases = sorted(n for n in tensors if n.endswith(_FALCON_BIASES))
    if biases:  # (Falcon-RW's form, which llama.cpp's Falcon does not load: it has no place for them)
        raise UnsupportedModelError(f"{path}: {biases[0]}: llama.cpp's Falcon has no linear biases")
    heads = int(config.num_attention_heads)
    kv = int(f.get("attention.head_count_kv", heads))
    if kv < 1 or heads % kv:
        raise UnsupportedModelError(f"{path}: falcon.attention.head_count_kv {kv} for {heads} heads")
    two_norms = "blk.0.attn_norm_2.weight" in tensors
    config.layer_norm_epsilon = float(f["attention.layer_norm_epsilon"])
    config.ffn_hidden_size = int(f["feed_forward_length"])
    config.tie_word_embeddings = "output.weight" not in tensors
    config.bias, config.alibi, config.parallel_attn = False, False, True
    if kv == 1 and not two_norms:  # Falcon-7B's: multi-query, one norm
        config.new_decoder_architecture, config.multi_query, config.num_kv_heads = False, True, heads
        config.num_ln_in_parallel_attn = None
    else:  # the new decoder's q / k / v grouped per KV head: 40B / 180B (two norms), Falcon2-11B (one)
        config.new_decoder_architecture, config.num_kv_heads = True, kv
        config.num_ln_in_parallel_attn = 2 if two_norms else 1
    config.num_key_value_heads = kv


def undo_layouts(model: Any, path: Path, info: dict[str, Any]) -> None:
    """Weights transformers' reader loads in llama.cpp's layout rather than the model's, or leaves out: Falcon's
    fused q / k / v rows, which llama.cpp's converter reorders from one group per KV head (queries, key, value) to
    all the queries, all the keys, all the values ("jploski"), back into groups (a Falcon file has no linear biases:
    `_falcon_config`); StableLM 2 12B's per-head q / k LayerNorms, one `attn_q_norm` / `attn_k_norm` row per head in
    the file, one module per head in transformers. `info`: transformers' loading info, less the weights read here."""
    if model.config.model_type == "falcon":
        _falcon_qkv(model)
    elif model.config.model_type == "stablelm":
        _stablelm_norms(model, path, info)


def _falcon_qkv(model: Any) -> None:
    import torch

    config = model.config
    if not config.new_decoder_architecture:
        return  # (7B's multi-query layout is the file's)
    heads, kv = int(config.num_attention_heads), int(config.num_kv_heads)
    head = config.hidden_size // heads
    for layer in model.transformer.h:
        weight = layer.self_attention.query_key_value.weight
        q, k, v = weight.detach().split([heads * head, kv * head, kv * head])
        grouped = torch.cat((q.reshape(kv, heads // kv, head, -1), k.reshape(kv, 1, head, -1),
                             v.reshape(kv, 1, head, -1)), dim=1)
        with torch.no_grad():
            weight.copy_(grouped.reshape(weight.shape))


def _stablelm_norms(model: Any, path: Path, info: dict[str, Any]) -> None:
    import torch
    from gguf.quants import dequantize

    if not model.config.qk_layernorm:
        return
    tensors = {t.name: t for t in open_file(path).tensors}
    read: set[str] = set()
    for i, layer in enumerate(model.model.layers):
        for kind, module in (("q", layer.self_attn.q_layernorm), ("k", layer.self_attn.k_layernorm)):
            t = tensors.get(f"blk.{i}.attn_{kind}_norm.weight")
            if t is None:
                continue  # (left missing: refused as such)
            rows = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
                tuple(int(d) for d in reversed(t.shape)))
            if rows.shape != (len(module.norms), module.dim):
                raise UnsupportedModelError(f"{path}: blk.{i}.attn_{kind}_norm.weight is {list(rows.shape)}, "
                                            f"[heads, head size] is {[len(module.norms), module.dim]}")
            with torch.no_grad():
                for h, norm in enumerate(module.norms):
                    norm.weight.copy_(torch.tensor(rows[h]))
                    read.add(f"model.layers.{i}.self_attn.{kind}_layernorm.norms.{h}.weight")
    if info.get("missing_keys"):
        info["missing_keys"] = set(info["missing_keys"]) - read


def transformers_config(path: Path, model_type: str) -> Any:
    """transformers' own config of a GGUF file of a family its reader handles, with what that reader drops put back
    as llama.cpp reads the file: the rotary scaling of the `rope.scaling.*` keys (transformers reads none: a
    Gemma 3 4B-27B file's linear 8 on its full layers, a yarn Qwen), the head size (`attention.key_length`: Qwen3's
    is not in its table), the experts' widths (Qwen2 / 3-MoE's), the rotated share of a head
    (`rope.dimension_count`: Phi-4-mini's 0.75), the rotary base (`rope.freq_base`: StarCoder2's is not in its
    table), Phi-3's window, Gemma 2's soft-caps, Gemma 2 and 3's query scale (27B's is not its head size), GPT-2's
    positions and MLP width (`context_length`, `feed_forward_length`), the biases a file has (no key says so:
    Nemotron's, Llama's, Mamba's projections'), Nemotron's LayerNorm epsilon, Falcon's form (`_falcon_config`),
    StableLM 2 12B's q / k norms."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    reader = open_file(path)
    arch = architecture(reader)
    f = _fields(reader, arch)
    tensors = {t.name: t for t in reader.tensors}
    if "attention.key_length" in f and getattr(config, "head_dim", None) is not None:  # (Qwen3's, not in
        config.head_dim = int(f["attention.key_length"])  # transformers' table: its default 128 would stand)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # (Gemma 2's: the class defaults would stand)
        if cap in f and hasattr(config, cap):
            setattr(config, cap, float(f[cap]))
    for key, field in (("expert_feed_forward_length", "moe_intermediate_size"),  # (Qwen2 / 3-MoE's: not in its
                       ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):  # tables)
        if key in f and hasattr(config, field):
            setattr(config, field, int(f[key]))
    for flag, names in _BIASES.items():  # (in no family's table: the class's default would load a file's biases
        if hasattr(config, flag):  # unread, or refuse a file without them; llama.cpp adds each one the file has)
            setattr(config, flag, any(f"blk.0.{name}.bias" in tensors for name in names))
    if config.model_type == "nemotron" and "attention.layer_norm_epsilon" in f:  # (llama.cpp's key; transformers
        config.norm_eps = float(f["attention.layer_norm_epsilon"])  # reads layer_norm_rms_epsilon, which the 2024
        # converter did not write)
    if config.model_type == "phi3" and "attention.sliding_window" in f:  # (0: none, as the converter writes Phi-4)
        config.sliding_window = int(f["attention.sliding_window"]) or None
    if config.model_type == "gpt2":  # (transformers reads the context as n_ctx, which GPT-2's model does not use,
        # and no MLP width: 1,024 positions and 4 x the width would stand; llama.cpp sizes both by these keys)
        if "context_length" in f:
            config.n_positions = int(f["context_length"])
        if "feed_forward_length" in f:
            config.n_inner = int(f["feed_forward_length"])
    if config.model_type == "falcon":
        _falcon_config(config, f, tensors, path)
    if config.model_type == "stablelm":  # (StableLM 2 12B's per-head q / k norms: transformers' reader drops them)
        norms = {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} & set(tensors)
        if len(norms) == 1:
            raise UnsupportedModelError(f"{path}: {next(iter(norms))} alone: transformers' StableLM norms both "
                                        "queries and keys or neither")
        config.qk_layernorm = bool(norms)
    if config.model_type in _GEMMA_27B_LAYERS:
        n = int(config.num_hidden_layers)
        config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads
                                        if n == _GEMMA_27B_LAYERS[config.model_type] else int(config.head_dim))
    try:
        scaled = _scaled_rope(f, tensors, path, arch)
    except KeyError as e:
        raise InputError(f"{path}: rotary scaling without {arch}.{e.args[0]}") from None
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope.dimension_count" in f and "full_attention" not in params:  # (none in a Mamba file: no heads)
        head = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        if int(f["rope.dimension_count"]) != head:  # (Phi-4-mini's 0.75: not read)
            scaled["partial_rotary_factor"] = int(f["rope.dimension_count"]) / head
    base = f.get("rope.freq_base")  # (StarCoder2's 1e5-1e6: not in transformers' table, whose class default
    if base is not None and "rope_theta" in params and float(params["rope_theta"]) != float(base):  # 10,000 would
        scaled["rope_theta"] = float(base)  # stand; llama.cpp rotates by the file's base)
    if scaled:
        if "full_attention" in params:  # a table per layer type (Gemma 3): llama.cpp scales the full layers'
            params["full_attention"] = {**params["full_attention"], **scaled}
        else:
            params.update(scaled)
        config.rope_parameters = params
    return config


# tensors llmc reads from the file itself (apply_rope_freqs, _scaled_rope), which transformers' map has no place for
_READ_BY_LLMC = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})
_QK_NORMS = re.compile(r"blk\.\d+\.attn_[qk]_norm\.weight")  # (StableLM 2 12B's: undo_layouts)
_EXPERTS = re.compile(r"(?P<name>.*\.ffn_(?:gate|down|up)_exps)\.weight$")


def check_all_read(model: Any, path: Path) -> None:
    """Refuses a file transformers' reader loaded without some of its tensors: its loader passes over a tensor its
    name map has no place for, silently (a Nemotron file's biases, where the config it read says none), so the
    model it built would not be the file's. The place of each tensor is found as that loader finds it (its name map
    from the model's parameters; its experts' stacks; GPT-2's head)."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = open_file(path)
    arch = architecture(reader)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    whole = SimpleNamespace(config=model.config, state_dict=model.state_dict, named_children=lambda: [])
    places = get_gguf_hf_weights_map(whole, processor)  # (the whole model's names only: its walk through every
    # submodule, for files of a base model's names, takes seconds)
    unread = []
    for tensor in reader.tensors:
        name = tensor.name
        experts = _EXPERTS.fullmatch(name)
        if name in places or name in _READ_BY_LLMC or (experts is not None and experts["name"] in places) or \
                (arch == "gpt2" and name == "output.weight") or (arch == "stablelm" and _QK_NORMS.fullmatch(name)):
            continue
        unread.append(name)
    if unread:
        shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        raise UnsupportedModelError(f"{path}: transformers' GGUF reader builds a {model.config.model_type} model "
                                    f"without {len(unread)} of the file's tensors ({shown}): it would not be the "
                                    "file's model")


def is_falcon_mamba(reader: Any) -> bool:
    """Whether a file is Falcon Mamba: llama.cpp's converter writes it as `mamba` with `ssm.dt_b_c_rms` set (the
    mixer's dt, B and C RMS-normalized), which transformers' reader does not look at."""
    norms = reader.fields.get("mamba.ssm.dt_b_c_rms")
    return architecture(reader) == "mamba" and norms is not None and bool(norms.parts[norms.data[0]][0])


def as_falcon_mamba(model: Any, path: Path) -> Any:
    """A Falcon Mamba file's model, which transformers' reader loads as Mamba (the same parameters, without the
    mixer's norms): the same weights in transformers' Falcon Mamba, moved, not copied. llama.cpp normalizes dt, B
    and C with the file's `layer_norm_rms_epsilon`, the blocks' (the checkpoint's own `mixer_rms_eps` is not in the
    file), so that is the mixer's epsilon here."""
    import torch
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    f = _fields(open_file(path), "mamba")
    fields = {k: v for k, v in model.config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version", "quantization_config")}
    config = FalconMambaConfig(**fields, mixer_rms_eps=float(f.get("attention.layer_norm_rms_epsilon", 1e-5)))
    with torch.device("meta"):
        falcon = FalconMambaForCausalLM(config)
    falcon.load_state_dict(model.state_dict(), strict=True, assign=True)
    falcon.tie_weights()
    falcon.generation_config = model.generation_config
    return falcon.eval()


def apply_rope_freqs(model: Any, path: Path) -> None:
    """A `rope_freqs` tensor (llama.cpp's per-frequency divisors: Llama 3.x's rotary scaling is written only so)
    divides transformers' rotary frequencies, which its reader leaves unscaled; a file whose rotated dims
    (`rope.dimension_count`) are not the model's is refused."""
    import torch

    reader = open_file(path)
    f = _fields(reader, architecture(reader))
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    from llmc.export.arch import _rotary

    rotary = _rotary(model)
    held = getattr(rotary, "inv_freq", None)
    if held is None:
        if freqs is not None:
            raise UnsupportedModelError(f"{path}: rope_freqs.weight on a model without one rotary table")
        return
    if "rope.dimension_count" in f and int(f["rope.dimension_count"]) != 2 * held.numel():
        raise UnsupportedModelError(f"{path}: {architecture(reader)}.rope.dimension_count {f['rope.dimension_count']} "
                                    f"rotated dims, transformers' model rotates {2 * held.numel()}")
    if freqs is None:
        return
    divisors = torch.from_numpy(np.array(freqs.data, dtype=np.float32).ravel())
    if divisors.numel() != held.numel():
        raise UnsupportedModelError(f"{path}: rope_freqs.weight has {divisors.numel()} factors for "
                                    f"{held.numel()} rotary frequencies")
    for name in ("inv_freq", "original_inv_freq"):
        if (table := getattr(rotary, name, None)) is not None:
            setattr(rotary, name, table / divisors.to(table.dtype))
