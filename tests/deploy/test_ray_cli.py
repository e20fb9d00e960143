"""`llmc deploy ray` as a user runs it: it starts a local Ray cluster, serves the OpenAI API on the port asked, and
on SIGTERM deletes the app, stops Ray and exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import ray.serve  # noqa: F401  (the ray extra: `make install` installs it; missing is a failure, not a skip)


def test_deploy_ray_serves_until_sigterm(deploy_engine_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llmc = Path(sys.executable).with_name("llmc")
    proc = subprocess.Popen([str(llmc), "deploy", "ray", str(deploy_engine_dir), "--replicas", "2", "--threads", "1",
                             "--kv-budget-mb", "64", "--port", str(port), "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    watchdog = threading.Timer(240, proc.kill)  # a hang fails the test (exit -9), never the whole run
    watchdog.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the app is up (every replica) when it says so
            if line.startswith("llmc on Ray Serve: "):
                break
        else:
            raise AssertionError(f"llmc deploy ray exited with {proc.wait()} before it served")
        assert line.strip() == f"llmc on Ray Serve: http://127.0.0.1:{port} (2 replicas); SIGTERM or Ctrl-C to stop"
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["tiny"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        watchdog.cancel()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)


def test_deploy_ray_bad_flags_are_one_line_errors(deploy_engine_dir: Path) -> None:
    from typer.testing import CliRunner

    from llmc.cli.main import app

    for flags, needle in ((["--replicas", "0"], "--replicas must be >= 1, got 0"),
                          (["--min-replicas", "3", "--max-replicas", "2"], "--max-replicas (2) must be >="),
                          (["--replicas", "5", "--max-replicas", "4"], "--replicas (5) must lie within"),
                          (["--port", "70000"], "--port must be in [1, 65535], got 70000"),
                          # was accepted, and the app said it listened on :0
                          (["--port", "0"], "--port must be in [1, 65535], got 0")):
        result = CliRunner().invoke(app, ["deploy", "ray", str(deploy_engine_dir), *flags])
        assert result.exit_code == 1, result.output
        assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"]
        assert needle in result.stderr, result.stderr


@pytest.mark.parametrize(("flags", "needle"), [
    # were accepted: an empty key served with no authentication, a non-ASCII one refused every request
    (["--api-key", ""], "--api-key (or LLMC_API_KEY) must be printable ASCII and not empty"),
    (["--api-key", "clé"], "--api-key (or LLMC_API_KEY) must be printable ASCII and not empty"),
    (["--served-model-name", ""], "--served-model-name must not be empty"),
    (["--host", ""], "--host must not be empty"),
    # named --max-step-tokens, a flag `llmc deploy ray` does not have
    (["--max-running", "600"], "--max-running must be <= 512 (the tokens per engine step of a replica), got 600"),
    # started a Ray cluster, then failed in every replica
    (["--chat-template", "/nonexistent.jinja"], "--chat-template /nonexistent.jinja is not a file"),
    # the local cluster waited forever (and SIGTERM did not end it) for a node with that many CPUs
    (["--threads", str((os.cpu_count() or 1) + 1)], "CPUs: the local Ray cluster could never place a replica"),
    # said '--max-replicas None'
    (["--replicas", "3", "--min-replicas", "4"], "must lie within [--min-replicas 4, --max-replicas (not set)]"),
])
def test_deploy_ray_refuses_before_starting_ray(deploy_engine_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                flags: list[str], needle: str) -> None:
    from typer.testing import CliRunner

    from llmc.cli.main import app
    from llmc.deploy import ray_app

    def serve(*args: object) -> None:
        raise AssertionError(f"{flags} were accepted: Ray Serve would start")

    monkeypatch.setattr(ray_app, "run_until_signal", serve)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = CliRunner().invoke(app, ["deploy", "ray", str(deploy_engine_dir), *flags])
    assert result.exit_code == 1 and not isinstance(result.exception, AssertionError), result.output
    assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"]
    assert needle in result.stderr, result.stderr


def test_deploy_ray_checks_the_engine_folder(tmp_path: Path, deploy_engine_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine folder without its weights was deployed: every replica then failed to load it."""
    from typer.testing import CliRunner

    from llmc.cli.main import app
    from llmc.deploy import ray_app

    monkeypatch.setattr(ray_app, "run_until_signal", lambda *a: pytest.fail("Ray Serve would start"))
    (tmp_path / "engine.json").write_text((deploy_engine_dir / "engine.json").read_text())
    result = CliRunner().invoke(app, ["deploy", "ray", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "lacks" in result.stderr and "rebuild it with `llmc build`" in result.stderr, result.stderr


def test_a_signal_while_deploying_stops_the_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM or Ctrl-C while the replicas start (or wait for room on the cluster) was only noted: the command
    went on waiting, and served if they ever started."""
    import time

    from llmc.deploy import ray_app
    from llmc.deploy.ray_settings import RayAppConfig

    calls: list[str] = []

    def slow_start(*args: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # Ray Serve waiting for the replicas
        calls.append("started")

    monkeypatch.setattr(ray_app, "connect", lambda address=None: None)
    monkeypatch.setattr(ray_app, "start", slow_start)
    monkeypatch.setattr(ray_app, "shutdown", lambda: calls.append("shutdown"))
    before = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        ray_app.run_until_signal(RayAppConfig(engine_dir="x"), "127.0.0.1", 8000)
    assert time.monotonic() - t0 < 4 and calls == ["shutdown"]
    assert signal.getsignal(signal.SIGTERM) is before
