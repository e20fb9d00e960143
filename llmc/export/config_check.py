"""A model's config.json checked before anything is loaded: dimensions that cannot make a model, or one this
machine cannot hold, are a one-line error naming the field, the value and the rule (not a traceback minutes in)."""

from __future__ import annotations

from typing import Any

from llmc.errors import InputError

# config.json names of the dimensions, per naming scheme (GPT-2 has its own).
_GPT2_NAMES = {"layers": "n_layer", "heads": "n_head", "hidden": "n_embd", "positions": "n_positions"}
_NAMES = {"layers": "num_hidden_layers", "heads": "num_attention_heads", "hidden": "hidden_size",
          "positions": "max_position_embeddings"}


def check_config(config: dict[str, Any], where: str) -> None:
    """Raise `InputError` for the first impossible dimension of `config` (from file `where`)."""
    names = _GPT2_NAMES if config.get("model_type") == "gpt2" else _NAMES
    dims = {k: _positive(config, name, where) for k, name in names.items()}
    vocab = _positive(config, "vocab_size", where)
    heads, hidden = dims["heads"], dims["hidden"]
    kv_heads = _positive(config, "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise InputError(f"{where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                         f"({kv_heads})")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise InputError(f"{where}: {names['hidden']} ({hidden}) must be divisible by {names['heads']} "
                             f"({heads}) when head_dim is not given")
        head_dim = hidden // heads
    else:
        head_dim = _positive(config, "head_dim", where)
    inner = config.get("intermediate_size") or config.get("n_inner") or 4 * hidden
    if not _is_int(inner) or inner < 1:
        raise InputError(f"{where}: intermediate_size must be a positive integer, got {inner!r}")
    _check_size(where, vocab, hidden, dims["layers"], heads * head_dim, kv_heads * head_dim, int(inner),
                tied=bool(config.get("tie_word_embeddings", config.get("model_type") == "gpt2")))


def _positive(config: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    value = config.get(name, default)
    if value is None:
        raise InputError(f"{where}: {name} is missing")
    if not _is_int(value) or value < 1:
        raise InputError(f"{where}: {name} must be a positive integer, got {value!r}")
    return int(value)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_size(where: str, vocab: int, hidden: int, layers: int, q: int, kv: int, inner: int, tied: bool) -> None:
    """Export holds the model in fp32 (torch) while it writes the graphs' weights: it must fit in memory."""
    import psutil

    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inner
    params = vocab * hidden * (1 if tied else 2) + layers * per_layer
    need, have = 4 * params, psutil.virtual_memory().total
    if need > have:
        raise InputError(f"{where}: these dimensions make a model of {params / 1e9:.3g} B parameters, "
                         f"{need / 2**30:,.1f} GiB in fp32, more than this machine's {have / 2**30:.1f} GiB of memory "
                         "(export holds the model in fp32)")
