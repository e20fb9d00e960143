"""`llmc serve` as a process: SIGTERM lets the in-flight request finish, then the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def _llmc() -> list[str]:
    exe = Path(sys.executable).parent / "llmc"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "llmc.cli.main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("llmc serve did not become healthy")


def test_sigterm_drains_the_stream_and_exits_zero(serve_engine_dir: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*_llmc(), "serve", str(serve_engine_dir), "--port", str(port), "--threads", "1",
           "--served-model-name", "tiny", "--shutdown-timeout", "30", "--log-level", "info", "--kv-budget-mb", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    try:
        _wait_healthy(url, proc)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "n": 8,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        usage, done, chunks = None, False, 0
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunks += 1
                if chunks == 2:
                    proc.send_signal(signal.SIGTERM)
                if line == "data: [DONE]":
                    done = True
                else:
                    usage = json.loads(line[6:]).get("usage") or usage
        assert done and usage is not None and usage["completion_tokens"] == 8 * 200
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = proc.stderr.read().decode() if proc.stderr else ""
    assert "Shutting down" in log
    # llmc's own start-up line, in uvicorn's format, before uvicorn's (the KV budget is mapped as the engine loads)
    assert log.index("INFO:     KV memory: 64 MB mapped at start-up in ") < log.index("Application startup complete")
