"""Constrained decoding in the sampler (llguidance masks per row), its compiler's checks and cache, logit_bias."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from llmc.errors import InputError
from llmc.runtime.request import SamplingParams
from llmc.runtime.sampler import Sampler, SequenceSamplingState
from llmc.runtime.structured import Constraint, GrammarCompiler
from llmc.runtime.tokenizer import Tokenizer

VOCAB = 320
EOS = 2  # <|im_end|> in the tiny tokenizer (special tokens: <|endoftext|>, <|im_start|>, <|im_end|>)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from tiny_models import make_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder, VOCAB)
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.to_json(), VOCAB, [EOS])


def _state(compiler: GrammarCompiler, params: SamplingParams) -> SequenceSamplingState:
    c = params.constraint
    return SequenceSamplingState(params, [1], [EOS], None if c is None else compiler.state(c))


def _run(sampler: Sampler, states: list[SequenceSamplingState], rng: np.random.Generator,
         steps: int, done: set[int] | None = None) -> list[list[int]]:
    """Sample `steps` tokens for every row from random logits (rows that end or fail stop taking tokens)."""
    done = set() if done is None else done
    for _ in range(steps):
        live = [i for i in range(len(states)) if i not in done]
        if not live:
            break
        out = sampler.sample(rng.normal(0, 3, (len(live), VOCAB)).astype(np.float32), [states[i] for i in live])
        for j, i in enumerate(live):
            g = states[i].grammar
            eos = int(out.token_ids[j]) == EOS and not states[i].params.ignore_eos
            if j in out.errors or (g is not None and g.done) or eos:
                done.add(i)
    return [s.generated for s in states]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constrained_row_matches_its_regex_and_the_others_are_untouched(
        compiler: GrammarCompiler, tokenizer: Tokenizer, temperature: float) -> None:
    pattern = r"[0-9]{2,4}-(ab|cd)"
    plain = SamplingParams(temperature=temperature, seed=7, max_tokens=40, ignore_eos=True)
    rows = [_state(compiler, SamplingParams(temperature=temperature, seed=1, regex=pattern)),
            _state(compiler, plain), _state(compiler, plain)]
    out = _run(Sampler(), rows, np.random.default_rng(0), 40)
    text = tokenizer.decode(out[0])
    assert re.fullmatch(pattern, text), text
    assert rows[0].grammar is not None and rows[0].grammar.done
    assert len(out[1]) == len(out[2]) == 40  # the plain rows ran on


def test_plain_rows_sample_the_same_with_or_without_a_constrained_row_beside_them(compiler: GrammarCompiler) -> None:
    logits = np.random.default_rng(3).normal(0, 3, (2, VOCAB)).astype(np.float32)
    plain = SamplingParams(temperature=1.0, seed=11)
    alone = Sampler().sample(logits[1:], [_state(compiler, plain)]).token_ids[0]
    beside = Sampler().sample(logits, [_state(compiler, SamplingParams(regex="[a-z]+")),
                                       _state(compiler, plain)]).token_ids[1]
    assert alone == beside


def test_the_output_is_json_for_the_schema_under_random_logits(compiler: GrammarCompiler,
                                                               tokenizer: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "s": {"enum": ["x", "y"]}},
              "required": ["n", "s"], "additionalProperties": False}
    states = [_state(compiler, SamplingParams(temperature=t, seed=i, json_schema=schema))
              for i, t in enumerate([0.0, 1.0, 1.0, 2.0])]
    for ids in _run(Sampler(), states, np.random.default_rng(1), 60):
        value = json.loads(tokenizer.decode(ids))
        assert set(value) == {"n", "s"} and 0 <= value["n"] <= 99 and value["s"] in ("x", "y")


def test_a_failing_grammar_fails_only_its_own_row(compiler: GrammarCompiler) -> None:
    bad = _state(compiler, SamplingParams(temperature=1.0, regex="[0-9]+"))
    assert bad.grammar is not None
    bad.grammar.allowed()
    bad.grammar._matcher.consume_token(5)  # a token the regex forbids: the matcher is in error from here on
    good = _state(compiler, SamplingParams(temperature=1.0, seed=2))
    out = Sampler().sample(np.zeros((2, VOCAB), np.float32), [bad, good])
    assert set(out.errors) == {0} and "failed while decoding" in str(out.errors[0])
    error = out.errors[0]  # the constraint's fault, not the engine's: the server answers 400 naming the field
    assert isinstance(error, InputError) and error.param == "regex" and "\n" not in str(error)
    assert good.generated == [int(out.token_ids[1])] and bad.generated == []


def test_masked_tokens_are_never_chosen_even_when_the_allowed_ones_are_neg_inf(compiler: GrammarCompiler,
                                                                              tokenizer: Tokenizer) -> None:
    state = _state(compiler, SamplingParams(temperature=0.0, regex="a"))
    assert state.grammar is not None
    allowed = np.flatnonzero(state.grammar.allowed())
    logits = np.zeros((1, VOCAB), np.float32)
    logits[0, allowed] = -np.inf  # the model rules out every allowed token: an error, never another token
    out = Sampler().sample(logits, [state])
    assert 0 in out.errors and state.generated == []


def test_a_constraint_is_compiled_once_and_cached(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer.to_json(), VOCAB, [EOS])
    c = Constraint.of({"type": "array", "items": {"type": "integer"}, "maxItems": 3}, None, None)
    assert c is not None
    for _ in range(5):
        compiler.state(c)
    assert compiler.compiled == 1 and compiler.hits == 4


@pytest.mark.parametrize(("params", "words"), [
    (SamplingParams(json_schema={"type": "strin"}), "Invalid type"),
    (SamplingParams(json_schema={"type": "string", "format": "no-such-format"}), "format"),
    (SamplingParams(json_schema={"$ref": "#/nowhere"}), "nowhere"),
    (SamplingParams(json_schema="{not json"), "not valid JSON"),
    (SamplingParams(regex="a[b"), "regular expression does not compile"),
    (SamplingParams(grammar="start: missing_rule"), "grammar does not compile"),
    # compile, then fail at their first mask or token (llguidance: NoExtensionBias, the lexer's limit)
    (SamplingParams(json_schema={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
     "fails at its first token"),
    (SamplingParams(regex="a{1000000}"), "too many expressions"),
])
def test_bad_constraints_are_input_errors_naming_the_problem(compiler: GrammarCompiler, params: SamplingParams,
                                                             words: str) -> None:
    params.validate(VOCAB)
    c = params.constraint
    assert c is not None
    with pytest.raises(InputError, match=re.escape(words)) as e:
        compiler.check(c)
    assert e.value.param == c.param and "\n" not in str(e.value)


def test_sampling_params_refuse_two_constraints_and_bad_logit_bias() -> None:
    with pytest.raises(InputError, match="at most one of json_schema, regex and grammar"):
        SamplingParams(json_schema={}, regex="a").validate()
    for bias, words in [({VOCAB: 1.0}, "vocab size"), ({3: 101.0}, "[-100, 100]"), ({3: float("nan")}, "[-100"),
                        ({-1: 1.0}, "token ids")]:
        with pytest.raises(InputError, match=re.escape(words)) as e:
            SamplingParams(logit_bias=bias).validate(VOCAB)
        assert e.value.param == "logit_bias"


def test_logit_bias_moves_the_choice(compiler: GrammarCompiler) -> None:
    logits = np.random.default_rng(5).normal(0, 1, (2, VOCAB)).astype(np.float32)
    favoured, banned = 17, int(np.argmax(logits[1]))
    out = Sampler().sample(logits, [_state(compiler, SamplingParams(temperature=1.0, logit_bias={favoured: 100.0})),
                                    _state(compiler, SamplingParams(temperature=0.0, logit_bias={banned: -100.0}))])
    assert out.token_ids[0] == favoured and out.token_ids[1] != banned


def test_a_grammar_file_in_gbnf_compiles_and_holds(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    gbnf = 'root ::= "(" [a-c]{1,5} ")"'
    states = [_state(compiler, SamplingParams(temperature=1.0, seed=s, grammar=gbnf)) for s in range(3)]
    for ids in _run(Sampler(), states, np.random.default_rng(2), 30):
        assert re.fullmatch(r"\([a-c]{1,5}\)", tokenizer.decode(ids)), tokenizer.decode(ids)


def test_tokenizer_json_round_trips(tokenizer: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(tokenizer.to_json())
    assert Tokenizer.from_dir(tmp_path).encode("hello world") == tokenizer.encode("hello world")


class _SlowMatcher:
    """A matcher whose mask takes `delay` seconds (allowing every token), to time where the mask is computed."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        import time

        time.sleep(self.delay)

    def consume_token(self, token: int) -> bool:
        return True

    def is_stopped(self) -> bool:
        return False

    def is_error(self) -> bool:
        return False


def test_the_next_mask_is_computed_while_the_engine_step_runs(compiler: GrammarCompiler) -> None:
    import time

    from llmc.runtime.structured import GrammarState

    state = GrammarState(_SlowMatcher(0.05), VOCAB, compiler.executor(), Constraint.of(None, "a", None))
    time.sleep(0.2)  # the prompt's prefill: the first mask is computed meanwhile
    state.allowed()
    t0 = time.perf_counter()
    state.advance(5)  # returns at once: the mask is computed on a worker thread
    assert time.perf_counter() - t0 < 0.03
    time.sleep(0.2)  # the engine step (4x the mask's time: room for a loaded machine)
    waited = state.wait_s
    state.allowed()
    assert state.wait_s - waited < 0.03  # ready: the sampler did not wait for it
    state.advance(6)
    state.allowed()  # no engine step in between: now the sampler waits
    assert state.wait_s - waited > 0.03


def test_a_schema_that_is_not_json_is_an_input_error() -> None:
    with pytest.raises(InputError, match="json_schema is not JSON") as e:
        SamplingParams(json_schema={"enum": {1, 2}}).constraint  # noqa: B018
    assert e.value.param == "json_schema"


def test_an_inf_or_nan_logit_outside_the_mask_is_never_chosen(compiler: GrammarCompiler) -> None:
    for value in (np.inf, np.nan):
        for temperature in (0.0, 1.0):
            state = _state(compiler, SamplingParams(temperature=temperature, regex="[0-9]"))
            assert state.grammar is not None
            allowed = state.grammar.allowed()
            logits = np.zeros((1, VOCAB), np.float32)
            logits[0, np.flatnonzero(~allowed)[:5]] = value
            token = int(Sampler().sample(logits, [state]).token_ids[0])
            assert allowed[token], (value, temperature, token)
