"""The operator library's self-test against the installed ONNX Runtime (llmc.engines.kernels.check_library): it
passes for the package's library and its verdict is kept; a library that does not register the operators, or
that crashes inside ONNX Runtime, is a one-line error naming what happened, never a crash of the caller."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from llmc.engines.kernels import _verdict_file, check_library, library_path
from llmc.errors import BackendUnavailableError


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMC_CACHE", str(tmp_path / "cache"))
    check_library.cache_clear()
    yield
    check_library.cache_clear()


def _compile(tmp_path: Path, body: str) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "no C compiler (installing llmc needs one: make install checks it)"
    src, lib = tmp_path / "fake.c", tmp_path / "libfake.so"
    src.write_text("#include <stddef.h>\n__attribute__((visibility(\"default\"))) void* RegisterCustomOps(void* o, "
                   "const void* b) { " + body + " }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def test_the_package_library_passes_and_the_verdict_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    library = library_path()
    check_library(library)
    assert _verdict_file(library).is_file()
    check_library.cache_clear()

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("ran the self-test again")

    monkeypatch.setattr(subprocess, "run", no_child)
    check_library(library)  # from the verdict


def test_a_library_without_the_operators_fails_naming_the_check(tmp_path: Path) -> None:
    lib = _compile(tmp_path, "(void)o; (void)b; return NULL;")
    with pytest.raises(BackendUnavailableError, match=r"fail their self-test against ONNX Runtime .*MatMulQ4"):
        check_library(lib)
    assert not _verdict_file(lib).exists()


def test_a_library_that_crashes_is_an_error_not_a_crash(tmp_path: Path) -> None:
    lib = _compile(tmp_path, "(void)o; (void)b; volatile int* p = NULL; *p = 1; return NULL;")
    with pytest.raises(BackendUnavailableError, match=r"crashed \(SIGSEGV\) in their self-test .*C API table"):
        check_library(lib)
