"""Output folders written whole or not at all: a temporary folder beside OUT, moved into place at the end."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmc.errors import InputError


def check_out_file(path: Path, flag: str) -> None:
    """Refuse, before any work, an output file that could not be written at the end of it."""
    if path.is_dir():
        raise InputError(f"{flag} {path} is a folder: give the path of a file")
    if not path.parent.is_dir():
        raise InputError(f"{flag} {path}: its folder {path.parent} does not exist")


def check_out_dir(out: Path, force: bool) -> None:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InputError(f"output directory {out} is not empty; pass --force to overwrite it")


@contextmanager
def atomic_dir(out: Path, source: Path, what: str) -> Iterator[Path]:
    """Yield a work folder; on success it replaces `out`, on any error it is removed and `out` is untouched.

    Refuses an `out` that overlaps `source` (the input), which --force would otherwise delete.
    """
    out, src = Path(out).resolve(), Path(source).resolve()
    if src == out or out in src.parents or src in out.parents:
        raise InputError(f"output {out} overlaps the {what} {src}; choose another output folder")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise InputError(f"output {out} cannot be made: {above} is a file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(out)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-{_host()}-", dir=out.parent))
    except OSError as e:  # a file in the path, a read-only or virtual file system (/proc), no permission
        raise InputError(f"output {out} cannot be made: {e.strerror or e} ({e.filename or out.parent})") from None
    try:
        yield work
        os.chmod(work, 0o755)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _host() -> str:
    """A short hash of this machine's name: a work folder's PID-HOST stamp (an output folder on a shared file
    system: another machine's pids are not ours to judge)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _remove_abandoned(out: Path) -> None:
    """Remove the work folders of earlier runs for `out` on this machine whose process is gone (killed outright:
    SIGKILL, the OOM killer, a power cut), which no handler could remove: a build's can hold a copy of the model's
    weights."""
    prefix = f".{out.name}.partial-"
    for folder in out.parent.glob(glob.escape(prefix) + "*"):
        pid, _, rest = folder.name[len(prefix):].partition("-")
        if (pid.isdigit() and int(pid) != os.getpid() and rest.startswith(_host() + "-") and not _alive(int(pid))
                and folder.is_dir()):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True
