"""The Makefile's deployment targets, as a pipeline calls them: `make package TARGET=...` writes the target's files,
and every error (a bad target, a missing engine, a bad replica count) exits non-zero with the one-line cause."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    # -o install: the environment under test is already installed (make would reinstall it when it is older
    # than pyproject.toml)
    return subprocess.run(["make", "-s", "-C", str(ROOT), "-o", "install", *args], capture_output=True, text=True,
                          timeout=300)



def test_package_target_writes_the_ray_config(deploy_engine_dir: Path, tmp_path: Path) -> None:
    done = _make("package", "TARGET=ray", f"ENGINE_DIR={deploy_engine_dir}", f"PACKAGE_DIR={tmp_path / 'p'}",
                 "PACKAGE_ARGS=--replicas 2")
    assert done.returncode == 0, done.stderr
    assert "replicas: 2" in (tmp_path / "p" / "config.yaml").read_text()


@pytest.mark.parametrize(("args", "needle"), [
    (("package", "TARGET=helm"), "'helm' is not one of"),
    (("package", "TARGET=docker", "ENGINE_DIR=/nonexistent/engine"), "engine folder /nonexistent/engine does not exist"),
    (("serve-ray", "REPLICAS=0"), "--replicas must be >= 1, got 0"),
    (("serve-ray", "ENGINE_DIR=/nonexistent/engine"), "/nonexistent/engine is not an engine folder"),
])
def test_targets_fail_on_errors(deploy_engine_dir: Path, tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    extra = () if any(a.startswith("ENGINE_DIR=") for a in args) else (f"ENGINE_DIR={deploy_engine_dir}",)
    done = _make(*args, *extra, f"PACKAGE_DIR={tmp_path / 'p'}")
    assert done.returncode != 0
    assert needle in " ".join(done.stderr.split()), done.stderr
    assert not (tmp_path / "p").exists()
