"""How a GGUF file's byte-level BPE vocabulary splits text before its merges, as the model's own tokenizer does.

A GGUF file has no `tokenizer.json`: llama.cpp's converter names the model's pre-tokenizer in `tokenizer.ggml.pre`
(it recognises the tokenizer by the ids it gives a test text), and llama.cpp splits text with the regular
expressions it keeps for that name. transformers' GGUF reader knows the Llama 3, Qwen2, Tekken and GPT-4o splits;
every other name gets GPT-2's. For the names below that is another tokenizer than the one the model was trained
with: StarCoder / StarCoder2, SmolLM, Command-R, EXAONE and Refact split every digit alone, Falcon splits
punctuation off and digits in threes, DeepSeek LLM and DeepSeek Coder split letters, punctuation, CJK runs and each
digit apart, StableLM 2 splits as Qwen2 does. A prompt with numbers in it then reaches the model as token ids it
never saw in training, and nothing says so. Llama 3 and Tekken vocabularies also take a piece that is a whole token
as that token without merging (`ignore_merges` in their tokenizer.json; llama.cpp likewise), which transformers'
reader leaves off.

`apply` puts the model's own split (the pre_tokenizer of its tokenizer.json) on the tokenizer transformers built
from the file. A name llama.cpp keeps a split of its own for that llmc does not reproduce is refused: the model's
Hugging Face checkpoint carries its tokenizer.json. "default", or no name (files older than the key), stays as
transformers reads it (GPT-2's split).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmc.errors import UnsupportedModelError

_GPT2 = [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}


def _split(pattern: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


_DIGITS_THEN_GPT2 = [{"type": "Digits", "individual_digits": True}, *_GPT2]
_QWEN2 = [_split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+"), _BYTES]
_LLAMA3 = [_split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+"), _BYTES]


def _chars(ranges: str) -> str:
    """A regex character class's body from code point ranges ("41-5A B5 ..."), the characters made here rather than
    written in the source: the classes below hold compatibility characters (U+1F7D, U+1FBE, U+2126, U+212A, ...)
    that any normalization of the text would turn into others, making a range run backwards or take in ASCII."""
    return "".join("-".join(chr(int(end, 16)) for end in item.split("-")) for item in ranges.split())


_CJK = f"[{_chars('4E00-9FA5 800-4E00 AC00-D7FF')}]+"  # (DeepSeek's "[一-龥ࠀ-一가-퟿]+")
_DEEPSEEK_LETTERS = "\\s?[" + _chars(  # (DeepSeek LLM's letters: Unicode's cased letters as of its tokenizer)
    "41-5A 61-7A B5 C0-D6 D8-F6 F8-1BA 1BC-1BF 1C4-293 295-2AF 370-373 376 377 37B-37D 37F 386 388-38A 38C 38E-3A1 "
    "3A3-3F5 3F7-481 48A-52F 531-556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77 1D79-1D9A "
    "1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 "
    "1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128 "
    "212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183 2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2 2CF3 A640-A66D "
    "A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 FF21-FF3A FF41-FF5A 10400-1044F "
    "104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 118A0-118DF 1E900-1E943") + "]+"
_DEEPSEEK_PUNCTUATION = "\\s?[!-/:-~" + _chars("FF01-FF0F FF1A-FF5E 2018-201F 3000-3002") + "]+"
_KANA = f"[{_chars('4E00-9FA5 3040-309F 30A0-30FF')}]+"  # (DeepSeek V3's "[一-龥぀-ゟ゠-ヿ]+")

# The pre_tokenizer of the tokenizer.json each name stands for (the steps in order), where transformers' reader
# builds another. (ignore_merges: the vocabulary's whole-token pieces are taken as they are.)
PRE_TOKENIZERS: dict[str, list[dict[str, Any]]] = {
    **{name: _DIGITS_THEN_GPT2 for name in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                                            "minerva-7b")},
    "falcon": [{"type": "Punctuation", "behavior": "Contiguous"}, *_GPT2,
               {"type": "Digits", "individual_digits": False}, _split("[0-9][0-9][0-9]")],
    "deepseek-llm": [_split("[\r\n]"), _split(_DEEPSEEK_LETTERS), _split(_DEEPSEEK_PUNCTUATION),
                     _split(r"\s+$"), _split(_CJK), {"type": "Digits", "individual_digits": True}, _BYTES],
    "deepseek-coder": [_split("[\r\n]"), _split(r"\s?\p{L}+"), _split(r"\s?\p{P}+"), _split(_CJK),
                       {"type": "Digits", "individual_digits": True}, _BYTES],
    "deepseek-v3": [_split(r"\p{N}{1,3}"), _split(_KANA),
                    _split(r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                           r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), _BYTES],
    **{name: _QWEN2 for name in ("stablelm2", "hunyuan")},
    **{name: _LLAMA3 for name in ("chatglm-bpe", "glm4")},
}
PRE_TOKENIZERS["hunyuan-dense"] = PRE_TOKENIZERS["deepseek-v3"]
IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                           "tekken"})
# names whose split transformers' reader already builds as the model's tokenizer.json has it (GPT-2's, or a table
# of its own: transformers.integrations.gguf.gguf_tokenizer_mapping.GGUF_PRE_TOKENIZER_SPLITS)
_GPT2_NAMES = frozenset({"default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
                         "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "jina-v1-en", "jina-v2-code",
                         "roberta-bpe", "gigachat", "a.x-4.0", "mellum"})


def _known_to_transformers() -> frozenset[str]:
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # (an older layout: its table under another name; only the names above then)
        return frozenset()
    return frozenset(GGUF_PRE_TOKENIZER_SPLITS)


def _step(spec: dict[str, Any]) -> Any:
    from tokenizers import Regex, pre_tokenizers

    kind = spec["type"]
    if kind == "Split":
        return pre_tokenizers.Split(Regex(spec["pattern"]["Regex"]), behavior=spec["behavior"].lower(),
                                    invert=spec["invert"])
    if kind == "Digits":
        return pre_tokenizers.Digits(individual_digits=spec["individual_digits"])
    if kind == "Punctuation":
        return pre_tokenizers.Punctuation(behavior=spec["behavior"].lower())
    return pre_tokenizers.ByteLevel(add_prefix_space=spec["add_prefix_space"], trim_offsets=spec["trim_offsets"],
                                    use_regex=spec["use_regex"])


def pre_tokenizer_of(steps: list[dict[str, Any]]) -> Any:
    """The tokenizers pre-tokenizer of steps in tokenizer.json's form."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([_step(spec) for spec in steps])


def pre_tokenizer(name: str) -> Any:
    """The tokenizers pre-tokenizer of `PRE_TOKENIZERS[name]`."""
    return pre_tokenizer_of(PRE_TOKENIZERS[name])


def _string(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def _name(reader: Any, path: Path) -> str | None:
    """The file's pre-tokenizer name where its vocabulary is byte-level BPE (None for SentencePiece and the others,
    which split no text this way); a name whose split llmc does not reproduce is refused."""
    if _string(reader, "tokenizer.ggml.model") != "gpt2":
        return None
    name = _string(reader, "tokenizer.ggml.pre") or "default"
    if name not in PRE_TOKENIZERS and name not in _GPT2_NAMES and name not in _known_to_transformers():
        raise UnsupportedModelError(f"{path}: tokenizer.ggml.pre {name!r}: llmc does not know how this vocabulary "
                                    "splits text before its merges (its model's tokenizer.json does); export the "
                                    "model's Hugging Face checkpoint instead")
    return name


def check(reader: Any, path: Path) -> None:
    """Refuses a file whose vocabulary's split llmc does not reproduce (before its model is loaded)."""
    _name(reader, path)


def apply(tokenizer: Any, reader: Any, path: Path) -> None:
    """The split the file's `tokenizer.ggml.pre` names put on `tokenizer` (transformers' fast tokenizer built from
    the file), and Llama 3 / Tekken's whole-token pieces."""
    name = _name(reader, path)
    backend = tokenizer.backend_tokenizer
    if name in PRE_TOKENIZERS:
        backend.pre_tokenizer = pre_tokenizer(name)
    if name in IGNORE_MERGES:
        backend.model.ignore_merges = True
