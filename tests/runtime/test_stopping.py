"""Stop conditions: EOS ids, stop token ids, stop strings across tokens, holdback, min/max tokens."""

from __future__ import annotations

import pytest

from llmc.runtime.request import FinishReason, SamplingParams
from llmc.runtime.stopping import StopChecker


def _feed(checker: StopChecker, pieces: list[tuple[int, str]]) -> tuple[list[str], FinishReason | None]:
    """Feed (token id, text) pairs until a finish; return the emitted chunks and the reason."""
    chunks: list[str] = []
    for n, (token_id, text) in enumerate(pieces, start=1):
        out, reason = checker.on_token(token_id, text, n)
        chunks.append(out)
        if reason is not None:
            return chunks, reason
    chunks.append(checker.flush())
    return chunks, None


def _text(pieces: list[str]) -> list[tuple[int, str]]:
    return [(100 + i, t) for i, t in enumerate(pieces)]


def test_stop_string_spanning_three_tokens_is_cut_and_not_emitted() -> None:
    checker = StopChecker(SamplingParams(stop=["<END>"]), eos_ids=[0])
    chunks, reason = _feed(checker, _text(["Hello", " world<", "EN", "D>tail", "more"]))
    assert reason is FinishReason.STOP
    assert "".join(chunks) == "Hello world"
    assert all("<" not in c for c in chunks)  # the partial stop string was never streamed
    assert chunks[1] == " world"  # "<" held back as soon as it could start "<END>"


def test_holdback_released_when_not_a_stop() -> None:
    checker = StopChecker(SamplingParams(stop=["<END>"]), eos_ids=[])
    out1, _ = checker.on_token(1, "a <E", 1)
    assert out1 == "a "
    out2, reason = checker.on_token(2, "X and", 2)
    assert (out2, reason) == ("<EX and", None)


def test_holdback_flushed_at_max_tokens() -> None:
    checker = StopChecker(SamplingParams(stop=["###"], max_tokens=2), eos_ids=[])
    assert checker.on_token(1, "x#", 1) == ("x", None)
    assert checker.on_token(2, "#", 2) == ("##", FinishReason.LENGTH)
    assert checker.flush() == ""


def test_earliest_of_several_stop_strings_wins() -> None:
    checker = StopChecker(SamplingParams(stop=["world", "lo w"]), eos_ids=[])
    chunks, reason = _feed(checker, _text(["Hel", "lo world"]))
    assert reason is FinishReason.STOP and "".join(chunks) == "Hel"


def test_stop_string_inside_one_token() -> None:
    checker = StopChecker(SamplingParams(stop=["\n\n"]), eos_ids=[])
    chunks, reason = _feed(checker, _text(["one", " two\n\nthree"]))
    assert reason is FinishReason.STOP and "".join(chunks) == "one two"


@pytest.mark.parametrize("eos", [0, 2])
def test_any_eos_id_stops(eos: int) -> None:
    checker = StopChecker(SamplingParams(), eos_ids=[0, 2])
    assert checker.on_token(5, "hi", 1) == ("hi", None)
    assert checker.on_token(eos, "", 2) == ("", FinishReason.STOP)


def test_ignore_eos() -> None:
    checker = StopChecker(SamplingParams(ignore_eos=True, max_tokens=3), eos_ids=[0])
    assert checker.on_token(0, "", 1) == ("", None)
    assert checker.on_token(0, "", 2) == ("", None)
    assert checker.on_token(0, "", 3) == ("", FinishReason.LENGTH)


def test_stop_token_id_text_not_emitted_but_held_text_is() -> None:
    checker = StopChecker(SamplingParams(stop_token_ids=[7], stop=["abc"]), eos_ids=[])
    assert checker.on_token(1, "xa", 1) == ("x", None)
    assert checker.on_token(7, "<tool>", 2) == ("a", FinishReason.STOP)


def test_min_tokens_defers_every_stop() -> None:
    params = SamplingParams(min_tokens=3, stop=["."], stop_token_ids=[9])
    checker = StopChecker(params, eos_ids=[0])
    assert checker.on_token(0, "", 1) == ("", None)
    assert checker.on_token(9, "a.", 2) == ("a.", None)
    assert checker.on_token(4, ".b", 3) == (".b", None)
    assert checker.on_token(4, "c.d", 4) == ("c", FinishReason.STOP)


def test_min_tokens_then_eos() -> None:
    checker = StopChecker(SamplingParams(min_tokens=1), eos_ids=[0])
    assert checker.on_token(0, "", 1) == ("", None)
    assert checker.on_token(0, "", 2) == ("", FinishReason.STOP)


def test_max_tokens_is_length() -> None:
    checker = StopChecker(SamplingParams(max_tokens=3), eos_ids=[0])
    chunks, reason = _feed(checker, _text(["a", "b", "c", "d"]))
    assert reason is FinishReason.LENGTH and chunks == ["a", "b", "c"]


def test_stop_on_last_allowed_token_is_stop_not_length() -> None:
    checker = StopChecker(SamplingParams(max_tokens=2, stop=["!"]), eos_ids=[])
    checker.on_token(1, "a", 1)
    assert checker.on_token(2, "b!", 2) == ("b", FinishReason.STOP)


def test_streamed_chunks_equal_final_text_char_by_char() -> None:
    text = "a<b<<E<EN<END!"
    checker = StopChecker(SamplingParams(stop=["<END"]), eos_ids=[])
    chunks, reason = _feed(checker, _text(list(text)))
    assert reason is FinishReason.STOP and "".join(chunks) == "a<b<<E<EN"
