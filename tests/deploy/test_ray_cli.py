"""`llmc deploy ray` as a user runs it: it starts a local Ray cluster, serves the OpenAI API on the port asked, and
on SIGTERM deletes the app, stops Ray and exits 0."""

from __future__ import annotations

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
                          (["--port", "70000"], "--port must be in [0, 65535], got 70000")):
        result = CliRunner().invoke(app, ["deploy", "ray", str(deploy_engine_dir), *flags])
        assert result.exit_code == 1, result.output
        assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"]
        assert needle in result.stderr, result.stderr
