"""A GGUF file's byte-level vocabulary splits text as its model's own tokenizer did (llmc/export/gguf_vocab.py):
transformers' reader gives GPT-2's split to every `tokenizer.ggml.pre` name outside its short table; and a
generation ends where llama.cpp ends it (llmc/export/gguf_read.end_of_generation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_files import write_family
from tiny_models import CORPUS, SPECIAL, make_model

from llmc.errors import UnsupportedModelError
from llmc.export import gguf_vocab
from llmc.export.sources import load, resolve


def _pieces(name: str, text: str) -> list[str]:
    return [p for p, _ in gguf_vocab.pre_tokenizer(name).pre_tokenize_str(text)]


@pytest.mark.parametrize(("names", "expected"), [
    # StarCoder (and StarCoder2), Refact, Command-R, SmolLM, CodeShell, EXAONE 3, Minerva: each digit alone
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
     ["In", "Ġ", "2", "0", "2", "4", ",", "Ġ$", "1", "2", ".", "5", "0", "Ġeach"]),
    # Falcon: punctuation apart, digits in threes (after the byte-level split)
    (("falcon",), ["In", "Ġ", "202", "4", ",", "Ġ", "$", "12", ".", "50", "Ġeach"]),
    # DeepSeek LLM / Coder: letters and punctuation runs with one blank before them, each digit alone
    (("deepseek-llm", "deepseek-coder"), ["In", "Ġ", "2", "0", "2", "4", ",", "Ġ$", "1", "2", ".", "5", "0", "Ġeach"]),
    # DeepSeek V3, Hunyuan dense: digits in threes first
    (("deepseek-v3", "hunyuan-dense"), ["In", "Ġ", "202", "4", ",", "Ġ$", "12", ".", "50", "Ġeach"]),
    # StableLM 2 (Qwen2's split), GLM-4 (Llama 3's)
    (("stablelm2", "hunyuan"), ["In", "Ġ", "2", "0", "2", "4", ",", "Ġ$", "1", "2", ".", "5", "0", "Ġeach"]),
    (("chatglm-bpe", "glm4"), ["In", "Ġ", "202", "4", ",", "Ġ$", "12", ".", "50", "Ġeach"]),
])
def test_each_name_splits_as_its_models_tokenizer(names: tuple[str, ...], expected: list[str]) -> None:
    for name in names:
        assert _pieces(name, "In 2024, $12.50 each") == expected, name
    assert set(gguf_vocab.PRE_TOKENIZERS) >= set(names)


def test_deepseeks_letters_are_the_letters_it_was_trained_with() -> None:
    """DeepSeek LLM's letter class holds compatibility characters (U+1F7D, U+1FBE, U+2126 Ohm, U+212A Kelvin) that a
    normalized copy of it turns into others: Kelvin's K into ASCII K would take in every character from "K" to
    U+212D (brackets, Latin-1 symbols), U+1F7D would make a range run backwards."""
    assert _pieces("deepseek-llm", "ab[cd") == ["ab", "[", "cd"]  # ("[" is not a letter)
    assert _pieces("deepseek-llm", "a©b") == ["a", "Â©", "b"]  # (nor "©")
    letters = gguf_vocab.pre_tokenizer_of([gguf_vocab.PRE_TOKENIZERS["deepseek-llm"][1]])  # (its letters step)
    for letter in ("\u1f7d", "\u1fbe", "\u2126", "\u212a", "\u1fd3", "\u1fdb"):
        assert [p for p, _ in letters.pre_tokenize_str(f"1 x{letter}y1")] == ["1", " x" + letter + "y", "1"], \
            hex(ord(letter))


def _numbers_vocab(folder: Path) -> None:
    """The tiny model's tokenizer retrained with GPT-2's split on text with numbers, so that its merges join digits
    ("20", "Ġ2024"): where the file's split keeps digits apart, the ids differ."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*CORPUS, "In 2024 we paid $12.50 each, 2024 times; 1999 and 2024."] * 8, trainer)
    tok.save(str(folder / "tokenizer.json"))


TEXTS = ["In 2024 we paid $12.50 each.", "The capital of France is Paris, 1999-2024!", "x = 202420242024"]


def test_a_gguf_vocabulary_splits_text_as_its_model_did(tmp_path: Path) -> None:
    """A StarCoder2-style vocabulary (each digit alone) read from its GGUF file: llmc's tokenizer gives the ids the
    model's tokenizer.json gives (its pre_tokenizer as published), and so does the export's saved tokenizer; GPT-2's
    split, which transformers' reader gives it, joins the digits."""
    from tokenizers import Tokenizer

    folder = make_model("llama", tmp_path / "m")
    _numbers_vocab(folder)
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(folder))
    path = write_family(hf, folder, tmp_path / "m.gguf", metadata={"tokenizer.ggml.pre": "starcoder"})
    spec = json.loads((folder / "tokenizer.json").read_text())
    gpt2 = Tokenizer.from_str(json.dumps(spec))
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [  # (bigcode/starcoder2's tokenizer.json)
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    reference = Tokenizer.from_str(json.dumps(spec))
    loaded = load(resolve(str(path)))
    loaded.tokenizer.save_pretrained(str(tmp_path / "saved"))
    saved = Tokenizer.from_file(str(tmp_path / "saved" / "tokenizer.json"))
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False).ids
        assert loaded.tokenizer.encode(text, add_special_tokens=False) == ids, text
        assert saved.encode(text, add_special_tokens=False).ids == ids, text
    assert any(gpt2.encode(t).ids != reference.encode(t).ids for t in TEXTS)  # (the test can tell them apart)


def test_llama3_vocabularies_take_whole_tokens_as_they_are(tmp_path: Path) -> None:
    """Llama 3's tokenizer.json (and llama.cpp for "llama-bpe", "tekken", ...) takes a piece that is a token whole,
    without its merges: a token no chain of merges reaches is still found."""
    folder = make_model("llama", tmp_path / "m")
    spec = json.loads((folder / "tokenizer.json").read_text())
    merges = spec["model"]["merges"]
    whole = spec["model"]["vocab"]["Ġcapital"]
    spec["model"]["merges"] = [m for m in merges if "".join(m if isinstance(m, list) else m.split(" ")) != "Ġcapital"]
    assert len(spec["model"]["merges"]) == len(merges) - 1  # (no chain of merges makes it now)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(folder))
    path = write_family(hf, folder, tmp_path / "m.gguf", metadata={"tokenizer.ggml.pre": "llama-bpe"})
    tokenizer = load(resolve(str(path))).tokenizer
    assert tokenizer.backend_tokenizer.model.ignore_merges
    assert tokenizer.encode("The capital", add_special_tokens=False)[-1] == whole


def test_a_split_llmc_does_not_reproduce_is_refused(tmp_path: Path) -> None:
    folder = make_model("llama", tmp_path / "m")
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(folder))
    path = write_family(hf, folder, tmp_path / "m.gguf", metadata={"tokenizer.ggml.pre": "kimi-k2"})
    with pytest.raises(UnsupportedModelError, match=r"tokenizer\.ggml\.pre 'kimi-k2'.*Hugging Face checkpoint"):
        resolve(str(path))


def _vocabulary(tmp: Path, tokens: list[str], **ids: int) -> object:
    """A GGUF file of only a vocabulary and its named tokens (`eos=3`, `eot=5`, ...), opened."""
    import gguf

    from llmc.export.gguf_read import open_file

    path = tmp / "v.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    for key, value in ids.items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return open_file(path)


@pytest.mark.parametrize(("tokens", "ids", "ends"), [
    # Llama 3.1 Instruct's file names <|end_of_text|> as its EOS: a chat turn ends at <|eot_id|> (or <|eom_id|>)
    (["a", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"], {"eos": 2}, [2, 3, 4]),
    # gpt-oss (harmony): <|end|> ends a message, not the generation
    (["a", "<|endoftext|>", "<|end|>", "<|return|>", "<|call|>"], {"eos": 3}, [3, 1, 4]),
    (["a", "<|end|>", "<|endoftext|>"], {"eos": 2}, [2, 1]),  # (Phi-3's <|end|> ends it)
    # Qwen2.5-Coder: the fill-in-the-middle pad and separators end it too, by key or by text
    (["a", "<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"], {"eos": 2}, [2, 3, 4, 5, 1]),
    (["a", "<end>", "<pad>", "b"], {"eos": 1, "eot": 3, "fim_pad": 2}, [1, 3, 2]),  # (named by keys only)
])
def test_a_generation_ends_where_llama_cpp_ends_it(tmp_path: Path, tokens: list[str], ids: dict[str, int],
                                                    ends: list[int]) -> None:
    from llmc.export.gguf_read import end_of_generation

    got = end_of_generation(_vocabulary(tmp_path, tokens, **ids))
    assert got[0] == ends[0] and sorted(got) == sorted(ends)  # (EOS first)


def test_a_gguf_models_generation_config_ends_where_llama_cpp_ends(tmp_path: Path) -> None:
    """The file holds no generation config: transformers' reader keeps its EOS alone (here <|endoftext|>), llmc
    adds the end of turn the vocabulary has (<|im_end|>)."""
    folder = make_model("llama", tmp_path / "m")
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(folder))
    path = write_family(hf, folder, tmp_path / "m.gguf", metadata={"tokenizer.ggml.eos_token_id": 0})
    (folder / "generation_config.json").unlink()  # (a file alone, as published)
    assert load(resolve(str(path))).model.generation_config.eos_token_id == [0, 2]
