"""Tokenizer loading, encode/decode, chat templates and UTF-8-safe streaming decode (no network)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from llmc.errors import InputError
from llmc.runtime.tokenizer import DecodeStream, Tokenizer

TEXT = "Hello 👋🏽 世界 café"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CORPUS = [
    "Hello world, hello there. The quick brown fox jumps over the lazy dog.",
    "café au lait, naïve résumé",
    "assistant user system: how are you? I am fine.",
] * 20
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 世界"}]


def _train(bos_post_processor: bool = False) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos_post_processor:  # Llama-style: the post-processor adds the BOS
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tok


def _model_dir(tmp: Path, config: dict | None = None, bos_post_processor: bool = False) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    _train(bos_post_processor).save(str(tmp / "tokenizer.json"))
    if config is None:
        config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp


def _id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_id(token)
    assert token_id is not None, token
    return token_id


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(_model_dir(tmp_path_factory.mktemp("tok")))


def test_encode_decode_roundtrip(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.vocab_size == 320 and max(ids) < tokenizer.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == tokenizer.token_id("<|im_end|>")


def test_decode_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = [_id(tokenizer, "<|im_start|>"), *tokenizer.encode("hi", add_special_tokens=False)]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi"


def _stream(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    stream = DecodeStream(tokenizer, prompt_ids=prompt_ids or [])
    return [stream.step(t) for t in ids] + [stream.flush()]


def test_decode_stream_utf8_safe(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The test means something only if some character's bytes are split over tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    chunks = _stream(tokenizer, ids)
    assert "".join(chunks) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in c for c in chunks)
    assert chunks[-1] == ""  # nothing left over at the end


def test_decode_stream_with_prompt_context(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Hello world", add_special_tokens=False)
    ids = tokenizer.encode(" 世界 café 👋🏽", add_special_tokens=False)
    assert "".join(_stream(tokenizer, ids, prompt)) == " 世界 café 👋🏽"


def test_decode_stream_window_is_bounded(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths: list[int] = []
    decode = tokenizer.decode

    def spy(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        lengths.append(len(ids))
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", spy)
    ids = tokenizer.encode((TEXT + " ") * 200, add_special_tokens=False)
    assert len(ids) > 2000
    assert "".join(_stream(tokenizer, ids)) == (TEXT + " ") * 200
    assert max(lengths) <= 8  # a few tokens per character, never the whole sequence


def test_decode_stream_incomplete_character_at_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab👋", add_special_tokens=False)
    partial = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    chunks = _stream(tokenizer, ids[:partial])
    assert "".join(chunks[:-1]) == "ab" and chunks[-1].endswith("\ufffd")


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40))
def test_decode_stream_matches_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    chunks = _stream(tokenizer, ids)
    assert "".join(chunks) == tokenizer.decode(ids)
    assert not any("\ufffd" in c for c in chunks) or "\ufffd" in text


def test_chat_template_render(tokenizer: Tokenizer) -> None:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 世界<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.token_id("<|im_start|>")  # special tokens in the text map to their ids


def test_chat_template_globals_and_filters(tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}{{ strftime_now('%Y')[:2] }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}[{{ m.content }}]{% endfor %}"
    )
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "<|endoftext|>",
        "chat_template": template,
    }
    tok = Tokenizer.from_dir(_model_dir(tmp_path, config))
    out = tok.apply_chat_template([{"role": "user", "content": "é"}, {"role": "user", "content": "x"}])
    assert out.startswith('<s>[{"role": "user", "content": "é"}') and out.endswith("20[é]")
    with pytest.raises(InputError, match="first message must be user"):
        tok.apply_chat_template(MESSAGES)


def test_missing_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_model_dir(tmp_path, {"eos_token": "<|endoftext|>"}))
    with pytest.raises(InputError) as exc:
        tok.apply_chat_template(MESSAGES)
    assert str(exc.value) == "model has no chat template; pass one with --chat-template FILE or use --raw"


def test_empty_messages(tokenizer: Tokenizer) -> None:
    with pytest.raises(InputError, match="messages must not be empty"):
        tokenizer.apply_chat_template([])


def test_template_sources_and_precedence(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    folder = _model_dir(tmp_path / "m", {"chat_template": named})
    assert Tokenizer.from_dir(folder).apply_chat_template(MESSAGES) == "DEFAULT"
    (folder / "chat_template.jinja").write_text("JINJA FILE")
    assert Tokenizer.from_dir(folder).apply_chat_template(MESSAGES) == "JINJA FILE"
    override = tmp_path / "mine.jinja"
    override.write_text("{{ messages | length }}")
    assert Tokenizer.from_dir(folder, chat_template_file=override).apply_chat_template(MESSAGES) == "2"
    with pytest.raises(InputError, match="chat template file not found"):
        Tokenizer.from_dir(folder, chat_template_file=tmp_path / "nope.jinja")


def test_bad_template_syntax(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_model_dir(tmp_path, {"chat_template": "{% for m in messages %}"}))
    with pytest.raises(InputError, match=r"chat template \(.*\) does not parse"):
        tok.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("add_bos_token", "post_processor", "expect_bos"),
    [(None, True, True), (None, False, False), (False, True, False), (True, False, True), (True, True, True)],
)
def test_bos_follows_tokenizer_json_and_config(
    tmp_path: Path, add_bos_token: bool | None, post_processor: bool, expect_bos: bool
) -> None:
    config: dict = {"bos_token": "<s>", "eos_token": "<|endoftext|>"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    tok = Tokenizer.from_dir(_model_dir(tmp_path, config, bos_post_processor=post_processor))
    ids = tok.encode("hello")
    bos = _id(tok, "<s>")
    assert (ids[0] == bos) is expect_bos and ids.count(bos) == int(expect_bos)
    assert bos not in tok.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize(("template", "error"), [
    ("{{ 'a' * 10**19 }}", "OverflowError"),
    ("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}", "TypeError"),
])
def test_a_template_that_raises_at_render_is_one_line_naming_it(tmp_path: Path, template: str, error: str) -> None:
    folder = _model_dir(tmp_path, {"chat_template": template})
    with pytest.raises(InputError, match=rf"chat template \(.*tokenizer_config.json\) raised while rendering: "
                                         rf"{error}") as e:
        Tokenizer.from_dir(folder).apply_chat_template(MESSAGES)
    assert "\n" not in str(e.value)


def test_a_lone_surrogate_is_refused_naming_where(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_model_dir(tmp_path, {}))
    with pytest.raises(InputError, match=r"lone UTF-16 surrogate \(U\+D800\) at character 2") as e:
        tok.encode("ab\ud800c")
    assert e.value.param == "prompt"


def test_a_long_text_encodes_as_a_short_one_does(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_model_dir(tmp_path, {}))
    text = "hello world. " * 3000  # past the length where encode_batch (no GIL) is used
    assert tok.encode(text) == tok._tok.encode(text).ids
