"""Flags out of range, flags another mode or backend would drop, outputs that could not be written at the end and
servers that cannot be reached: one `error:` line and exit 1 before any work, never a traceback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import Built

from .test_cli import _assert_user_error, _cli


@pytest.fixture
def closed_url() -> Iterator[str]:
    """A local URL nothing listens on (the port held, so no one else takes it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_verify_steps_past_the_context(tiny_llama: Built) -> None:
    _assert_user_error(_cli("verify", tiny_llama.engine_dir, "--steps", "300"), "--steps 300", "holds 256")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_serve_shutdown_timeout_not_finite(value: str) -> None:
    _assert_user_error(_cli("serve", "no-engine", "--shutdown-timeout", value), "--shutdown-timeout", value)


def test_build_trt_flags_on_another_backend(tmp_path: Path) -> None:
    for flags in (["--max-seq-len", "4096"], ["--precision", "fp32", "--backend", "ort-cuda"]):
        _assert_user_error(_cli("build", tmp_path / "export", "-o", tmp_path / "engine", *flags), " ".join(flags[:2]),
                           "--backend trt")
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize(("plot", "words"), [
    ("nowhere/p.png", "its folder"),
    (".", "is a folder"),
    ("p.txt", "not .txt"),
])
def test_bench_plot_that_could_not_be_written(tmp_path: Path, plot: str, words: str) -> None:
    _assert_user_error(_cli("bench", tmp_path / "engine", "--plot", tmp_path / plot), "--plot", words)


def test_bench_serve_without_a_server(closed_url: str) -> None:
    _assert_user_error(_cli("bench", "--serve", closed_url), closed_url, "All connection attempts failed")
    _assert_user_error(_cli("bench", "--serve", "localhost:8000"), "localhost:8000", "unsupported protocol")
    _assert_user_error(_cli("serve-bench", closed_url), closed_url, "All connection attempts failed")


@pytest.mark.parametrize("models", [b"<html>not JSON</html>", b'{"data": []}', b'{"object": "list"}'])
def test_bench_serve_against_a_server_that_lists_no_model(models: bytes) -> None:
    """GET /v1/models answered, but not with a model: was a JSONDecodeError / IndexError / KeyError traceback."""

    requests: list[str] = []

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Length", str(len(models)))
            self.end_headers()
            self.wfile.write(models)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
            requests.append(format % args)  # kept for the asserts below instead of printed to stderr

    with ThreadingHTTPServer(("127.0.0.1", 0), Models) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for command in (["bench", "--serve", url], ["serve-bench", url]):
            _assert_user_error(_cli(*command, "--num-prompts", "1"), "/v1/models answered", "not an OpenAI list")
        server.shutdown()
    # each command asked for the model list once, and sent no completion to a server that listed no model
    assert [r.split('"')[1] for r in requests] == ["GET /v1/models HTTP/1.1"] * 2, requests


@pytest.mark.parametrize(("flags", "words"), [
    (["--batch-sizes", "1000000000"], "--batch-sizes 1000000000 at 6 positions needs"),  # was killed for memory
    (["--contexts", "100000"], "the longest run needs 100002 positions"),
    (["--bandwidth-gbs", "inf"], "--bandwidth-gbs must be a finite number > 0, got inf"),
])
def test_bench_runs_past_the_engine_or_the_machine(tiny_llama: Built, flags: list[str], words: str) -> None:
    _assert_user_error(_cli("bench", tiny_llama.engine_dir, "--prompt-len", "4", "--new-tokens", "2",
                            "--repeat", "1", *flags), words)


@pytest.mark.parametrize(("command", "flags", "words"), [
    ("bench", ["--output", "{tmp}"], "--output {tmp} is a folder"),
    ("bench", ["--output", "{tmp}/nowhere/out.json"], "its folder {tmp}/nowhere does not exist"),
    ("bench", ["--request-rate", "nan"], "--request-rate must be >= 0"),
    ("bench", ["--new-tokens", "0"], "--new-tokens must be >= 1"),
    ("bench", ["--against", "{tmp}"], "--against is for an engine folder's benchmark"),
    ("bench", ["--compare-torch"], "--compare-torch is for an engine folder's benchmark"),
    ("serve-bench", ["--output", "{tmp}"], "--output {tmp} is a folder"),
    ("serve-bench", ["--num-prompts", "0"], "--num-prompts must be >= 1"),
    ("serve-bench", ["--concurrency", "0"], "--concurrency must be >= 1"),
    ("serve-bench", ["--request-rate", "0"], "--request-rate must be > 0"),
    ("serve-bench", ["--request-rate", "-1"], "--request-rate must be > 0"),
    ("serve-bench", ["--endpoint", "chats"], "--endpoint must be chat or completions"),
])
def test_serve_benchmark_flags(tmp_path: Path, closed_url: str, command: str, flags: list[str], words: str) -> None:
    target = ["--serve", closed_url] if command == "bench" else [closed_url]  # `bench --serve URL`, `serve-bench URL`
    _assert_user_error(_cli(command, *target, *(f.format(tmp=tmp_path) for f in flags)), words.format(tmp=tmp_path))


@pytest.mark.parametrize(("out", "words"), [
    ("/proc/llmc-out", "cannot be made: No such file or directory"),  # was mkdtemp's FileNotFoundError traceback
    ("{file}/sub/engine", "is a file"),
])
def test_build_output_that_cannot_be_made(tiny_llama: Built, tmp_path: Path, out: str, words: str) -> None:
    (tmp_path / "f").write_text("")
    out = out.format(file=tmp_path / "f")
    _assert_user_error(_cli("build", tiny_llama.export_dir, "-o", out), f"output {out} cannot be made", words)
