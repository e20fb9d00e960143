"""The `llmc` command line on a tiny engine: help, run, verify, build, and one-line user errors (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import Result
from conftest import Built
from typer.testing import CliRunner

from llmc import LLM, SamplingParams
from llmc.cli.main import app

COMMANDS = ("export", "build", "run", "verify")


def _cli(*args: object, input: str | None = None, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], input=input, env=env)


def _assert_user_error(result: Result, *needles: str) -> str:
    """Exit 1 with one `error: ...` line on stderr naming each needle, and no traceback. Returns the line."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert "Traceback" not in result.output
    return errors[0]


@pytest.fixture(scope="module")
def engine_dir(tiny_llama: Built) -> Path:
    return tiny_llama.engine_dir


@pytest.fixture(scope="module")
def llm(engine_dir: Path) -> LLM:
    return LLM(engine_dir)


# -- help -----------------------------------------------------------------------------------------------------

def test_app_help_lists_commands() -> None:
    result = _cli("--help")
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command: str) -> None:
    result = _cli(command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage" in result.stdout


def test_version() -> None:
    import llmc

    result = _cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"llmc {llmc.__version__}"


# -- run ------------------------------------------------------------------------------------------------------

def test_run_prompt_prints_the_chat_answer(engine_dir: Path, llm: LLM) -> None:
    result = _cli("run", engine_dir, "What is the capital of France?", "--max-tokens", "5", "--temperature", "0")
    assert result.exit_code == 0, result.output
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
    assert expected, "the tiny model should say something for this prompt"
    assert result.stdout == expected + "\n"


def test_run_raw_skips_the_chat_template(engine_dir: Path, llm: LLM) -> None:
    prompt = "The capital of France is"
    result = _cli("run", engine_dir, prompt, "--raw", "--max-tokens", "5", "--temperature", "0")
    assert result.exit_code == 0, result.output
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
    assert result.stdout == expected + "\n"
    templated = _cli("run", engine_dir, prompt, "--max-tokens", "5", "--temperature", "0")
    assert templated.exit_code == 0
    chat = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=5))
    assert templated.stdout == chat[0].outputs[0].text + "\n"


def test_run_with_seed_is_reproducible(engine_dir: Path) -> None:
    args = ("run", engine_dir, "Hello", "--max-tokens", "8", "--temperature", "1.0", "--seed", "7")
    first, second = _cli(*args), _cli(*args)
    assert first.exit_code == 0 and second.exit_code == 0
    assert first.stdout == second.stdout


@pytest.mark.parametrize(("flags", "field"), [
    (("--temperature", "-1"), "temperature"),
    (("--top-p", "1.5"), "top_p"),
    (("--top-p", "0"), "top_p"),
    (("--max-tokens", "0"), "max_tokens"),
    (("--min-p", "2"), "min_p"),
    (("--repetition-penalty", "0"), "repetition_penalty"),
])
def test_run_bad_sampling_values(engine_dir: Path, flags: tuple[str, str], field: str) -> None:
    _assert_user_error(_cli("run", engine_dir, "hi", *flags), field, flags[1])


def test_run_negative_threads(engine_dir: Path) -> None:
    _assert_user_error(_cli("run", engine_dir, "hi", "--threads", "-1"), "--threads", "-1")


def test_run_prompt_longer_than_context(engine_dir: Path) -> None:
    prompt = "Once upon a time there was a tiny language model. " * 60
    line = _assert_user_error(_cli("run", engine_dir, prompt, "--raw", "--max-tokens", "5"), "256")
    assert "context" in line


def test_run_prompt_plus_max_tokens_over_context(engine_dir: Path) -> None:
    _assert_user_error(_cli("run", engine_dir, "hi", "--max-tokens", "300"), "300", "256")


def test_run_on_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "nothing").mkdir()
    cache = tmp_path / "cache"
    _assert_user_error(_cli("run", tmp_path / "nothing", "hi", env={"LLMC_CACHE": str(cache)}), "config.json")
    _assert_user_error(_cli("run", tmp_path / "missing", "hi", env={"LLMC_CACHE": str(cache)}), "does not exist")
    assert not (cache / "exports").exists() or not any((cache / "exports").iterdir())


def test_run_on_an_export_builds_into_the_cache(tmp_path: Path, tiny_llama: Built, llm: LLM) -> None:
    env = {"LLMC_CACHE": str(tmp_path / "cache")}
    args = ("run", tiny_llama.export_dir, "Hello", "--raw", "--max-tokens", "4", "--temperature", "0")
    first = _cli(*args, env=env)
    assert first.exit_code == 0, first.output
    engines = list((tmp_path / "cache" / "engines").iterdir())
    assert len(engines) == 1 and (engines[0] / "engine.json").is_file()
    assert first.stdout == llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text + "\n"
    second = _cli(*args, env=env)
    assert second.exit_code == 0 and second.stdout == first.stdout
    assert "building" not in second.stderr, "the cached engine is reused"


def test_interactive_chat(engine_dir: Path, llm: LLM) -> None:
    result = _cli("run", engine_dir, "--max-tokens", "5", "--temperature", "0", input="hello\n/exit\n")
    assert result.exit_code == 0, result.output
    answer = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=5))
    assert answer[0].outputs[0].text + "\n" in result.stdout
    assert result.stdout.count("> ") == 2


def test_interactive_chat_ends_at_eof(engine_dir: Path) -> None:
    result = _cli("run", engine_dir, "--max-tokens", "3", input="hello\n")
    assert result.exit_code == 0, result.output


# -- verify ---------------------------------------------------------------------------------------------------

def test_verify(engine_dir: Path) -> None:
    result = _cli("verify", engine_dir)
    assert result.exit_code == 0, result.output
    assert "100.0%" in result.stdout


def test_verify_min_top1_out_of_range(engine_dir: Path) -> None:
    _assert_user_error(_cli("verify", engine_dir, "--min-top1", "1.5"), "--min-top1", "1.5")


def test_verify_on_an_export_folder(tiny_llama: Built) -> None:
    _assert_user_error(_cli("verify", tiny_llama.export_dir), "engine.json")


# -- build ----------------------------------------------------------------------------------------------------

def test_build_trt_is_refused_clearly(tmp_path: Path, tiny_llama: Built) -> None:
    line = _assert_user_error(_cli("build", tiny_llama.export_dir, "--backend", "trt", "-o", tmp_path / "trt"))
    assert "TensorRT" in line and "--backend ort" in line
    assert not (tmp_path / "trt").exists()
    assert not list(tmp_path.glob(".trt.partial-*"))


def test_build_ort_from_the_cli(tmp_path: Path, tiny_llama: Built) -> None:
    out = tmp_path / "engine"
    result = _cli("build", tiny_llama.export_dir, "-o", out)
    assert result.exit_code == 0, result.output
    assert (out / "engine.json").is_file()
    assert "top-1 100%" in result.stdout
    _assert_user_error(_cli("build", tiny_llama.export_dir, "-o", out), "not empty", "--force")
    assert _cli("build", tiny_llama.export_dir, "-o", out, "--force").exit_code == 0


def test_build_negative_threads(tmp_path: Path, tiny_llama: Built) -> None:
    _assert_user_error(_cli("build", tiny_llama.export_dir, "-o", tmp_path / "e", "--threads", "-1"), "--threads", "-1")
    assert not (tmp_path / "e").exists()


def test_build_from_a_folder_that_is_not_an_export(tmp_path: Path, tiny_llama: Built) -> None:
    _assert_user_error(_cli("build", tiny_llama.hf_dir, "-o", tmp_path / "e"), "llmc.json")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(("flags", "prefault"), [((), True), (("--no-kv-prefault",), False)])
def test_serve_maps_its_kv_budget_at_start_unless_told_not_to(monkeypatch: pytest.MonkeyPatch, engine_dir: Path,
                                                              flags: tuple[str, ...], prefault: bool) -> None:
    import llmc.pipeline
    import llmc.serve.server
    from llmc.serve.app import ServeConfig

    seen: list[ServeConfig] = []
    monkeypatch.setattr(llmc.pipeline, "ensure_engine", lambda ref, progress=None: Path(ref))
    monkeypatch.setattr(llmc.serve.server, "run_server", lambda source, config, log_level="info": seen.append(config))
    result = _cli("serve", engine_dir, "--kv-budget-mb", "64", *flags)
    assert result.exit_code == 0, result.output
    assert [(c.runtime.kv_prefault, c.runtime.kv_budget_mb) for c in seen] == [(prefault, 64)]
    assert ServeConfig().runtime.kv_prefault  # an app made without the CLI serves the same way


def test_serve_log_level_is_one_of_uvicorn_s_and_a_wrong_one_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                         engine_dir: Path) -> None:
    import llmc.pipeline
    import llmc.serve.server

    seen: list[object] = []
    monkeypatch.setattr(llmc.pipeline, "ensure_engine", lambda ref, progress=None: Path(ref))
    monkeypatch.setattr(llmc.serve.server, "run_server",
                        lambda source, config, log_level="info": seen.append(log_level))
    result = _cli("serve", engine_dir, "--log-level", "bogus")
    assert result.exit_code == 2 and seen == [] and "Traceback" not in result.output  # (was a ValueError)
    assert "'bogus' is not one of" in result.output and "'trace'" in result.output
    assert _cli("serve", engine_dir, "--log-level", "trace").exit_code == 0 and seen == ["trace"]


def test_a_terminated_build_leaves_no_partial_output(tmp_path: Path, tiny_llama: Built) -> None:
    """SIGTERM (a pipeline's timeout, a container stopping) mid-build: exit 143 and "terminated", the work folder
    and the precision search's calibration files (inside it) removed, the output folder never made."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "engine"
    child = subprocess.Popen([sys.executable, "-m", "llmc.cli.main", "build", str(tiny_llama.export_dir), "-o",
                              str(out), "--quant", "int4"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.is_dir() for w in tmp_path.glob(".engine.partial-*") for p in w.iterdir()):  # (calibrating)
        assert child.poll() is None and time.monotonic() < deadline, child.stderr.read() if child.stderr else ""
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "terminated" and "Traceback" not in stderr
    assert not out.exists() and not list(tmp_path.iterdir())
