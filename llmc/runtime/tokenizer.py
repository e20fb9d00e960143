"""A Hugging Face tokenizer (tokenizer.json via `tokenizers`), its chat template, and streaming decode."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmc.errors import InputError, LimitError, one_line

NO_TEMPLATE_MSG = "model has no chat template; pass one with --chat-template FILE or use --raw"
_LONG_TEXT = 16_384  # characters: above this, encode without holding the GIL


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Prompts rendered by `apply_chat_template` already hold the template's special tokens (often the
    BOS), so encode them with `add_special_tokens=False`, as transformers does.
    """

    def __init__(self, tok: tokenizers.Tokenizer, config: dict[str, Any], chat_template: str | None,
                 chat_template_source: str = "the model's chat template") -> None:
        self._tok = tok
        self.chat_template_source = chat_template_source  # where the template came from, for error messages
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        add_bos = config.get("add_bos_token")
        self._add_bos: bool | None = add_bos if isinstance(add_bos, bool) else None
        # Whether tokenizer.json's post-processor adds the BOS itself (Llama-style TemplateProcessing).
        empty_ids = tok.encode("", add_special_tokens=True).ids
        self._pp_adds_bos = self.bos_token_id is not None and empty_ids[:1] == [self.bos_token_id]

    @classmethod
    def from_dir(cls, path: str | Path, chat_template_file: str | Path | None = None) -> Tokenizer:
        """Load `tokenizer.json` and `tokenizer_config.json` from a model folder.

        The chat template comes from, in order: `chat_template_file`, `chat_template.jinja`,
        `chat_template.json`, then `chat_template` in tokenizer_config.json (a string, or a list of
        {name, template} of which "default" or else the first is used).
        """
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise InputError(f"no tokenizer.json in {folder}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise InputError(f"cannot load {tok_file}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        template, source = _find_chat_template(folder, config, chat_template_file)
        return cls(tok, config, template, source)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """Token ids of `text`; special tokens are added as tokenizer.json's post-processor says,
        with tokenizer_config's `add_bos_token` (when given) deciding about the BOS. More than `limit` tokens is
        a `LimitError` (raised before the ids of a huge text are turned into a list).

        A long text goes through `encode_batch_fast` (no offsets), which releases the GIL: `encode` holds it for
        the whole call, and a 5 MB text would stall every other thread for seconds."""
        _check_text(text)
        if len(text) > _LONG_TEXT:
            batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
            enc = batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        if limit is not None and len(enc) > limit + 1:  # (+1: a BOS the lines below may take off)
            raise LimitError(f"prompt has {len(enc)} tokens, the context holds {limit}", "prompt")
        ids: list[int] = enc.ids
        if not add_special_tokens or self._add_bos is None or self.bos_token_id is None:
            return ids
        if self._add_bos and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        if not self._add_bos and self._pp_adds_bos and ids[:1] == [self.bos_token_id]:
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what constrained decoding builds its token table from)."""
        return str(self._tok.to_str())

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render `messages` with the chat template, as transformers' `apply_chat_template` does; `tools` (OpenAI's
        `{"type": "function", "function": {...}}` entries) are the template's to render."""
        if not messages:
            raise InputError("messages must not be empty", "messages")
        messages = [chat_message(i, m) for i, m in enumerate(messages)]
        template = self._compiled_template()
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **({"tools": tools} if tools else {}),
            )
        except jinja2.TemplateError as e:
            raise InputError(f"chat template ({self.chat_template_source}) failed: {one_line(e)}") from e
        except Exception as e:  # the template's own code raised (OverflowError, TypeError, ...): still its fault
            raise InputError(f"chat template ({self.chat_template_source}) raised while rendering: "
                             f"{type(e).__name__}: {one_line(e)}") from e

    def decode_stream(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)

    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise InputError(NO_TEMPLATE_MSG)
        if self._template is None:
            try:
                self._template = _jinja_env().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise InputError(f"chat template ({self.chat_template_source}) does not parse: {e.message} "
                                 f"(line {e.lineno})") from e
        return self._template

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


class DecodeStream:
    """Incremental, UTF-8-safe detokenization of generated tokens.

    The prefix/read offset algorithm of vLLM and text-generation-inference: decode the ids from
    `prefix` on, compare with the decode of ids[prefix:read], and emit the difference unless it ends
    in U+FFFD (a character whose bytes are split over tokens, still incomplete). Only the ids from
    `prefix` on are kept, so each step decodes a few tokens, whatever the sequence length. The
    prefix gives context to decoders that depend on the previous token (e.g. leading spaces).
    """

    _CONTEXT = 5  # prompt tokens kept as context for the first generated token

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self._CONTEXT :]) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        # Drop ids before the new prefix: they no longer affect what is emitted.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text of tokens not emitted yet (an unfinished character decodes as U+FFFD, as a full decode would)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        del self._ids[: len(self._ids) - min(len(self._ids), self._CONTEXT)]
        self._prefix, self._read = 0, len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config: a string, or a serialized AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise InputError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _find_chat_template(folder: Path, config: dict[str, Any],
                        override: str | Path | None) -> tuple[str | None, str]:
    """The chat template and where it came from (a file, for error messages)."""
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise InputError(f"chat template file not found: {path}")
        return _read_text(path), str(path)
    if (folder / "chat_template.jinja").is_file():
        return _read_text(folder / "chat_template.jinja"), str(folder / "chat_template.jinja")
    from_json = _read_json(folder / "chat_template.json").get("chat_template")
    template = from_json or config.get("chat_template")
    source = folder / ("chat_template.json" if from_json else "tokenizer_config.json")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return (template if isinstance(template, str) and template else None), str(source)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None


def _check_text(text: str) -> None:
    """Refuse a string that is not Unicode text (a lone surrogate, e.g. from undecodable bytes in argv)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"prompt holds a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}) at character "
                             f"{e.start}, which is not text", "prompt") from None


def chat_message(i: int, m: Any) -> dict[str, Any]:
    """Message i as chat templates read it: a string role, and its content one string (OpenAI's text parts joined,
    no content an empty string). A part the model cannot read (an image, audio, a file) is refused, never dropped:
    the answer would ignore it."""
    if not isinstance(m, dict) or "role" not in m:
        raise InputError(f"messages[{i}] must be an object with a 'role', got {m!r:.80}", "messages")
    if not isinstance(m["role"], str):
        raise InputError(f"messages.{i}.role must be a string, got {m['role']!r:.40}", "messages")
    content = m.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise InputError(f"messages.{i}.content.{j} is a content part of type {kind!r}: this model reads text "
                                 "only (parts of type 'text')", "messages")
            if not isinstance(part.get("text"), str):
                raise InputError(f"messages.{i}.content.{j} is a text part without 'text'", "messages")
        return {**m, "content": "".join(part["text"] for part in content)}
    if content is None:
        return {**m, "content": ""}
    if not isinstance(content, str):
        raise InputError(f"messages.{i}.content must be a string or a list of text parts, got {content!r:.40}",
                         "messages")
    return m


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters, which changes prompts; transformers replaces it too.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
