"""Output folders written whole or not at all, and the work folders of runs killed outright removed by the next."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmc.outdir import _host, atomic_dir


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_run_s_work_folder_is_removed_by_the_next_run_for_the_same_output(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    gone = _dead_pid()
    dead = tmp_path / f".engine.partial-{gone}-{_host()}-abc123"
    alive = tmp_path / f".engine.partial-{os.getppid()}-{_host()}-def456"  # (a live process: a run still going)
    other = tmp_path / f".other.partial-{gone}-{_host()}-ghi789"  # (another output's: left to its own next run)
    elsewhere = tmp_path / f".engine.partial-{gone}-0badc0de-jkl012"  # (another machine's: its pids are not ours)
    unstamped = tmp_path / ".engine.partial-xyz"  # (no pid in the name: not known to be abandoned)
    for folder in (dead, alive, other, elsewhere, unstamped):
        folder.mkdir()
        (folder / "weights.bin").write_bytes(b"x" * 16)
    with atomic_dir(tmp_path / "engine", tmp_path / "src", "export") as work:
        assert work.name.startswith(f".engine.partial-{os.getpid()}-{_host()}-")
        (work / "done").write_text("1")
    assert not dead.exists() and alive.exists() and other.exists() and elsewhere.exists() and unstamped.exists()
    assert (tmp_path / "engine" / "done").read_text() == "1"


def test_a_failed_run_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "engine", tmp_path / "src", "export") as work:
        (work / "partial").write_text("1")
        raise RuntimeError("stop")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
