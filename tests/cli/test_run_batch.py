"""`llmc run ENGINE --input prompts.jsonl --output results.jsonl` over a FakeEngine (with a real tokenizer): results in
input order, error records for bad lines, resume after an interruption, and one-line user errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from runtime.fake_engine import EngineCall, FakeEngine, greedy_reference
from tiny_models import make_tokenizer
from typer.testing import CliRunner

from llmc.cli.main import app
from llmc.runtime.batch_file import BatchConfig, run_batch
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.generator import EngineLoop
from llmc.runtime.llm import LLM, LLMConfig
from llmc.runtime.request import SamplingParams
from llmc.runtime.tokenizer import Tokenizer

EOS = 2  # <|im_end|> of the tiny tokenizer
MAX_POS = 128
POISON = 319  # a prompt [POISON, k, ...] makes the FakeEngine fail once its slot would hold more than k tokens


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder, 320)
    return folder


@dataclass
class Engines:
    """Stands in for engine loading: each `LLM(...)` the command makes gets a FakeEngine built here."""

    tok_dir: Path
    on_call: Callable[[EngineCall], None] | None = None
    made: list[LLM] = field(default_factory=list)

    def llm(self, engine_dir: Any = None, config: LLMConfig | None = None) -> LLM:
        config = config or LLMConfig()
        llm = LLM.__new__(LLM)
        llm.engine_dir, llm.tokenizer = self.tok_dir, Tokenizer.from_dir(self.tok_dir)
        engine = FakeEngine(vocab=llm.tokenizer.vocab_size, max_pos=MAX_POS, eos_ids=(EOS,), poison=POISON,
                            on_call=self.on_call)
        llm.engine = engine
        llm.loop = EngineLoop(engine, llm.tokenizer, RuntimeConfig(max_running=config.max_running, kv_budget_mb=1))
        self.made.append(llm)
        return llm

    @property
    def engine(self) -> FakeEngine:
        engine = self.made[-1].engine
        assert isinstance(engine, FakeEngine)
        return engine


@pytest.fixture
def engines(tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Engines:
    import llmc.pipeline
    import llmc.runtime.llm

    made = Engines(tok_dir)
    monkeypatch.setattr(llmc.runtime.llm, "LLM", made.llm)
    monkeypatch.setattr(llmc.pipeline, "ensure_engine", lambda ref, progress=None: Path(ref))
    return made


def cli(*args: object) -> Result:
    return CliRunner().invoke(app, ["run", "engine", *(str(a) for a in args)])


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def prefill_rows(engine: FakeEngine) -> int:
    return sum(len(c.slots) for c in engine.calls if c.kind == "prefill" and not c.failed)


GOOD = [
    {"id": "a", "prompt": "The capital of France is", "max_tokens": 12},
    {"prompt": "Hello world!", "max_tokens": 3, "ignore_eos": True},
    {"id": 7, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 9},
    {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "ignore_eos": True},
    {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0.8, "seed": 3, "top_k": 20},
    {"prompt": "tiny language model", "max_tokens": 1},
    # OpenAI's content parts, and an assistant message without content (were the template's TypeError)
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "it?"}]},
                  {"role": "assistant", "content": None}, {"role": "user", "content": "Go on"}], "max_tokens": 4},
]
BAD = [
    ('{"prompt": "unterminated', "invalid JSON"),
    ({"prompt": "x", "temprature": 0.5}, "unknown field 'temprature'"),
    ({"prompt": "x", "top_p": 2}, "top_p must be in (0, 1], got 2"),
    ({"prompt": [3] * 200}, "prompt has 200 tokens, the context holds 128"),
    ({"id": "no-prompt", "max_tokens": 3}, "exactly one of 'prompt' and 'messages'"),
    ({"prompt": "x", "n": 2}, "unknown field 'n' (one completion per line"),
    ({"prompt": "x", "stop": 5}, "stop must be a list, got 5"),
    ({"messages": [{"content": "no role"}]}, "messages[0] must be an object with a 'role'"),
    ("[1, 2]", "a line must be a JSON object, got list"),
    # these failed the whole batch with a traceback (RecursionError), or were read where they should not be
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "the line nests JSON deeper than it can be read"),
    ('{"prompt": "x", "max_tokens": 1' + "0" * 5000 + "}", "invalid JSON: Exceeds the limit (4300 digits)"),
    ({"prompt": "x", "logit_bias": {"+5": 1}}, "logit_bias keys must be token ids (integers), got '+5'"),
    ({"prompt": "x", "constraint_param": "regex"}, "unknown field 'constraint_param'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content must be a string or a list of text parts"),
    ({"messages": [{"role": 5, "content": "hi"}]}, "messages.0.role must be a string, got 5"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0 is a content part of type 'image_url': this model reads text only"),
]


def expected_tokens(tok: Tokenizer, line: dict[str, Any]) -> list[int]:
    """What a greedy line generates, from the FakeEngine's formula (no loop, no engine)."""
    if "messages" in line:
        ids = tok.encode(tok.apply_chat_template(line["messages"]), add_special_tokens=False)
    else:
        ids = line["prompt"] if isinstance(line["prompt"], list) else tok.encode(line["prompt"])
    return greedy_reference(ids, line["max_tokens"], (EOS,), line.get("ignore_eos", False), tok.vocab_size)


# -- results -------------------------------------------------------------------------------------------------------

def test_results_in_input_order_with_error_records(engines: Engines, tmp_path: Path) -> None:
    cases: list[tuple[Any, str | None]] = []
    for i in range(max(len(GOOD), len(BAD))):
        cases += [(GOOD[i], None)] if i < len(GOOD) else []
        cases += [BAD[i]] if i < len(BAD) else []
    lines = [line for line, _ in cases]
    src = write_lines(tmp_path / "prompts.jsonl", lines[:3] + ["   "] + lines[3:])  # a blank line is skipped
    in_flight: list[int] = []
    engines.on_call = lambda call: in_flight.append(len(engines.made[-1].loop.requests))
    result = cli("--input", src, "--output", tmp_path / "out.jsonl", "--max-running", "2")
    assert result.exit_code == 0, result.output
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["index"] for r in out] == list(range(len(cases)))
    assert not (tmp_path / "out.jsonl.partial").exists()
    assert max(in_flight) <= 2  # lines are fed as slots free up, not all at once
    tok = engines.made[-1].tokenizer
    for record, (line, error) in zip(out, cases):
        if error is not None:
            assert set(record) <= {"index", "id", "error"} and error in record["error"], record
            continue
        assert set(record) == {"id", "index", "text", "token_ids", "finish_reason", "prompt_tokens",
                               "completion_tokens"}
        assert record["id"] == line.get("id") and record["completion_tokens"] == len(record["token_ids"])
        assert record["finish_reason"] in ("stop", "length") and isinstance(record["text"], str)
        if "temperature" not in line:
            assert record["token_ids"] == expected_tokens(tok, line)
    assert out[[line for line, _ in cases].index(BAD[4][0])]["id"] == "no-prompt"
    assert f"wrote {len(cases)} results ({len(BAD)} errors) to" in result.stderr
    assert "tok/s" in result.stderr


def test_flags_are_defaults_that_lines_override(engines: Engines, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": [5, 6]}, {"prompt": [5, 6], "max_tokens": 2}])
    result = cli("--input", src, "--output", tmp_path / "out.jsonl", "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["token_ids"] for r in out] == [greedy_reference([5, 6], 5, (EOS,), vocab_size=320),
                                             greedy_reference([5, 6], 2, (EOS,), vocab_size=320)]
    assert [r["prompt_tokens"] for r in out] == [2, 2]


def test_logit_bias_keys_are_token_ids_as_json_writes_them(engines: Engines, tmp_path: Path) -> None:
    """JSON object keys are strings: a line's logit_bias {"57": -100} was refused ("keys must be token ids")."""
    first = greedy_reference([5, 6], 1, (EOS,), vocab_size=320)[0]
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": [5, 6], "max_tokens": 1},
                                              {"prompt": [5, 6], "max_tokens": 1, "logit_bias": {str(first): -100}}])
    result = cli("--input", src, "--output", tmp_path / "out.jsonl")
    assert result.exit_code == 0, result.output
    plain, biased = read_jsonl(tmp_path / "out.jsonl")
    assert plain["token_ids"] == [first] and "error" not in biased and biased["token_ids"] != [first]


def test_engine_error_is_recorded_and_the_rest_run(engines: Engines, tmp_path: Path) -> None:
    poisoned = [POISON, 0, 5]  # fails at prefill
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": [5, 6], "max_tokens": 4, "ignore_eos": True},
                                              {"prompt": poisoned, "max_tokens": 4}, {"prompt": [7], "max_tokens": 4}])
    result = cli("--input", src, "--output", tmp_path / "out.jsonl")
    assert result.exit_code == 0, result.output
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["finish_reason"] for r in out] == ["length", "error", out[2]["finish_reason"]]
    assert "error" in out[1] and out[2]["token_ids"] == greedy_reference([7], 4, (EOS,), vocab_size=320)


def test_progress_callback_counts_lines(engines: Engines, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [{"prompt": [5 + i], "max_tokens": 3} for i in range(5)] + ["{"])
    seen: list[tuple[int, int, int]] = []
    summary = run_batch(engines.llm(config=LLMConfig(max_running=2)), BatchConfig(src, tmp_path / "out.jsonl"),
                        lambda done, total, new: seen.append((done, total, new)))
    dones = [d for d, _, _ in seen]
    assert dones == sorted(dones) and dones[-1] == 6 and {t for _, t, _ in seen} == {6}
    assert sum(n for _, _, n in seen) == summary.completion_tokens > 0
    assert (summary.total, summary.resumed, summary.errors) == (6, 0, 1)


# -- resume ------------------------------------------------------------------------------------------------------

def interrupt_after_prefills(engines: Engines, n: int) -> None:
    def hook(call: EngineCall) -> None:
        if call.kind == "prefill" and prefill_rows(engines.engine) > n:
            raise KeyboardInterrupt

    engines.on_call = hook


def test_interrupted_run_resumes_without_redoing_lines(engines: Engines, tmp_path: Path) -> None:
    lines = [{"prompt": [5 + i] * (i + 1), "max_tokens": 4 + i % 3, "ignore_eos": True} for i in range(10)]
    src, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    sidecar = tmp_path / "out.jsonl.partial"
    interrupt_after_prefills(engines, 4)
    first = cli("--input", src, "--output", out, "--max-running", "2")
    assert first.exit_code == 130 and "run the same command to resume" in first.stderr
    assert not out.exists() and sidecar.exists()
    done = {r["index"] for r in read_jsonl(sidecar)[1:]}
    assert 0 < len(done) < 10

    engines.on_call = None
    second = cli("--input", src, "--output", out, "--max-running", "2")
    assert second.exit_code == 0, second.output
    assert prefill_rows(engines.engine) == 10 - len(done)  # finished lines are not run again
    assert f"{len(done)} from an earlier run" in second.stderr
    records = read_jsonl(out)
    assert [r["token_ids"] for r in records] == [
        greedy_reference(x["prompt"], x["max_tokens"], (EOS,), True, 320) for x in lines]
    assert not sidecar.exists()


def test_resume_after_a_kill_mid_write(engines: Engines, tmp_path: Path) -> None:
    lines = [{"prompt": [5, 6, i + 3], "max_tokens": 3} for i in range(6)]
    src, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    interrupt_after_prefills(engines, 3)
    assert cli("--input", src, "--output", out, "--max-running", "1").exit_code == 130
    sidecar = tmp_path / "out.jsonl.partial"
    done = len(read_jsonl(sidecar)) - 1
    with open(sidecar, "a", encoding="utf-8") as f:
        f.write('{"index": 5, "text": "half a rec')  # killed while writing
    engines.on_call = None
    result = cli("--input", src, "--output", out, "--max-running", "1")
    assert result.exit_code == 0, result.output
    assert prefill_rows(engines.engine) == 6 - done
    assert [r["index"] for r in read_jsonl(out)] == list(range(6)) and "text" in read_jsonl(out)[5]


def test_sidecar_of_another_input_is_refused(engines: Engines, tmp_path: Path) -> None:
    src, out = write_lines(tmp_path / "in.jsonl", [{"prompt": [5], "max_tokens": 3}] * 4), tmp_path / "out.jsonl"
    interrupt_after_prefills(engines, 2)
    assert cli("--input", src, "--output", out, "--max-running", "1").exit_code == 130
    write_lines(src, [{"prompt": [6], "max_tokens": 3}] * 4)
    result = cli("--input", src, "--output", out)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"error: {out}.partial is from another input file (or not an llmc batch sidecar); delete it to start over"]


# -- user errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["--input", "{tmp}/missing.jsonl", "--output", "{tmp}/out.jsonl"], "input file not found: {tmp}/missing.jsonl"),
    (["--input", "{tmp}/in.jsonl"], "--input and --output go together"),
    (["--output", "{tmp}/out.jsonl"], "--input and --output go together"),
    (["hello", "--input", "{tmp}/in.jsonl", "--output", "{tmp}/out.jsonl"], "either a PROMPT or --input"),
    (["--input", "{tmp}/in.jsonl", "--output", "{tmp}/nowhere/out.jsonl"], "its folder {tmp}/nowhere does not exist"),
    (["--input", "{tmp}/in.jsonl", "--output", "{tmp}/in.jsonl"], "--output must differ from --input"),
    (["--input", "{tmp}/in.jsonl", "--output", "{tmp}/out.jsonl", "--max-running", "0"], "--max-running must be >= 1"),
    (["--input", "{tmp}/in.jsonl", "--output", "{tmp}"], "--output {tmp} is a folder: give the path of a file"),
    (["--input", "{tmp}/in.jsonl", "--output", "{tmp}/out.jsonl", "--system", "be brief"],
     "--raw and --system shape a PROMPT, not --input lines"),
    (["--input", "{tmp}/in.jsonl", "--output", "{tmp}/out.jsonl", "--raw"], "--raw and --system shape a PROMPT"),
    (["hello", "--raw", "--system", "be brief"], "--system goes into the chat template, which --raw skips"),
    (["--raw"], "--raw needs a PROMPT"),
    (["hello", "--force"], "--force replaces an existing --output file"),
])
def test_user_errors_are_one_line_before_loading(engines: Engines, tmp_path: Path, args: list[str],
                                                 message: str) -> None:
    write_lines(tmp_path / "in.jsonl", [{"prompt": "x"}])
    result = cli(*(a.format(tmp=tmp_path) for a in args))
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [f"error: {message.format(tmp=tmp_path)}"] or (
        len(result.stderr.strip().splitlines()) == 1 and message.format(tmp=tmp_path) in result.stderr)
    assert "Traceback" not in result.output
    assert engines.made == []  # no engine was loaded


def test_an_existing_output_is_replaced_only_with_force(engines: Engines, tmp_path: Path) -> None:
    src, out = write_lines(tmp_path / "in.jsonl", [{"prompt": "x", "max_tokens": 2}]), tmp_path / "out.jsonl"
    out.write_text("an earlier run's results\n")
    result = cli("--input", src, "--output", out)
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [f"error: --output {out} already exists; pass --force to replace it"]
    assert out.read_text() == "an earlier run's results\n" and engines.made == []
    result = cli("--input", src, "--output", out, "--force")
    assert result.exit_code == 0, result.output
    assert [r["index"] for r in read_jsonl(out)] == [0]


def test_empty_input_writes_empty_output(engines: Engines, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", ["", "  "])
    result = cli("--input", src, "--output", tmp_path / "out.jsonl")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out.jsonl").read_text() == ""


def test_defaults_of_batch_config() -> None:
    config = BatchConfig(Path("a.jsonl"), Path("out/b.jsonl"))
    assert config.sidecar == Path("out/b.jsonl.partial") and config.defaults == SamplingParams()


# -- a real engine ---------------------------------------------------------------------------------------------------

def test_real_engine_batch_equals_generate(tiny_llama: Any, tmp_path: Path) -> None:
    """The tiny ONNX engine end to end: batch results are what LLM.generate / LLM.chat give one by one."""
    lines = [{"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True},
             {"messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 9, "ignore_eos": True},
             {"prompt": "Once upon a time there was a tiny language model", "max_tokens": 4, "ignore_eos": True},
             {"prompt": "x", "max_tokens": 0}]
    src, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["run", str(tiny_llama.engine_dir), "--input", str(src), "--output", str(out),
                                      "--max-running", "2"])
    assert result.exit_code == 0, result.output
    records = read_jsonl(out)
    llm = LLM(tiny_llama.engine_dir)
    greedy = [SamplingParams(max_tokens=x["max_tokens"], temperature=0.0, ignore_eos=True) for x in lines[:3]]
    alone = [llm.generate(lines[0]["prompt"], greedy[0])[0], llm.chat(lines[1]["messages"], greedy[1])[0],
             llm.generate(lines[2]["prompt"], greedy[2])[0]]
    for record, want in zip(records, alone):
        assert record["token_ids"] == want.outputs[0].token_ids and record["text"] == want.outputs[0].text
        assert record["prompt_tokens"] == len(want.prompt_token_ids)
    assert records[3] == {"index": 3, "error": "max_tokens must be >= 1, got 0"}
