"""The docker target's image, as far as it can be made without a Docker engine: its requirement set and wheel
install into a fresh virtual environment (no torch, no transformers), and the Dockerfile's own entry point and
health check, run from there, serve the engine."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from llmc.deploy.package import PackageConfig, Target, package


def _dockerfile_json(text: str, instruction: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(instruction + " "))
    return json.loads(line.removeprefix(instruction + " "))


def _healthcheck(text: str) -> list[str]:
    start = text.index("HEALTHCHECK")
    body = text[start:text.index("\n\n", start)].replace("\\\n", " ")
    return json.loads(body[body.index("CMD ") + 4:].strip())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def image(deploy_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the build context, a fresh venv with the image's requirement set installed)."""
    root = tmp_path_factory.mktemp("docker")
    ctx = root / "ctx"
    package(PackageConfig(deploy_engine_dir, Target.docker, ctx, name="tiny", threads=1, kv_budget_mb=64))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    wheel = next((ctx / "wheels").glob("llmc-*.whl"))
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "-r",
                           str(ctx / "requirements.txt"), str(wheel)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return ctx, venv


def test_requirement_set_has_no_training_stack(image: tuple[Path, Path]) -> None:
    _, venv = image
    probe = ("import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None for m in "
             "('torch', 'transformers', 'llmc', 'onnxruntime', 'fastapi', 'uvicorn')}))")
    found = json.loads(subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                                      check=True).stdout)
    assert found == {"torch": False, "transformers": False, "llmc": True, "onnxruntime": True, "fastapi": True,
                     "uvicorn": True}


def test_entry_point_serves_and_health_check_passes(image: tuple[Path, Path], tmp_path: Path) -> None:
    ctx, venv = image
    text = (ctx / "Dockerfile").read_text()
    port = _free_port()
    entry = _dockerfile_json(text, "ENTRYPOINT")
    # the container's paths and addresses, on this machine: the engine folder copied into the context, loopback
    args = [str(ctx / "engine") if a == "/engine" else "127.0.0.1" if a == "0.0.0.0" else a for a in entry]
    args[args.index("--port") + 1] = str(port)
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "LLMC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = [a.replace(":8000/", f":{port}/") for a in _healthcheck(text)]
        deadline = time.monotonic() + 60
        while subprocess.run(health, env=env, capture_output=True).returncode != 0:
            assert proc.poll() is None, proc.communicate()[0][-2000:]
            assert time.monotonic() < deadline, "the health check never passed"
            time.sleep(0.3)
        url = f"http://127.0.0.1:{port}"
        models = httpx.get(url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 5,
                                                             "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        bad = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": -1})
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-2000:]
