"""The streaming kernels of the built operator library keep their software prefetches.

GCC treats a helper whose only statements are prefetches as a function without effects: where it does not inline
such a helper (attend_avx512 grew past --param large-function-growth), it deletes the calls, silently. The
attention kernel ran that way, with no prefetch at all, until prefetch_row was made always_inline (one decode row
over 2,048 cached tokens, one thread: 225 -> 160 us a layer). This reads the library's machine code: each kernel that
streams a cache or weights from memory must hold prefetch instructions."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from collections import Counter

from llmc.engines.kernels import library_path

STREAMING = ("attend_avx512", "unit_vnni", "unit_avx2", "unit_avx512", "unit_f512", "read_ahead")


X86 = platform.machine() in ("x86_64", "AMD64", "i386", "i686")


def _prefetches_per_function() -> tuple[set[str], Counter[str]]:
    """The library's functions, and the prefetch instructions in each (GCC's clones counted with their origin)."""
    objdump = shutil.which("objdump")
    assert objdump is not None, "no objdump: binutils, which building the library needs, is missing"
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library_path())], check=True,
                          capture_output=True, text=True).stdout
    counts: Counter[str] = Counter()
    seen: set[str] = set()
    function = ""
    for line in text.splitlines():
        header = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if header:
            function = header.group(1).split(".")[0]  # (GCC's clones: attend_avx512.constprop.0)
            seen.add(function)
        elif "prefetch" in line:
            counts[function] += 1
    assert "llmc_ops_version" in seen, f"{library_path().name} carries no symbols to tell its kernels apart"
    return seen, counts


def test_every_streaming_kernel_prefetches() -> None:
    seen, counts = _prefetches_per_function()
    if not X86:  # the x86 kernels are not built here: the portable ones, which prefetch nothing, run
        assert seen.isdisjoint(STREAMING), sorted(seen & set(STREAMING))
        return
    assert [f for f in STREAMING if f not in seen] == [], "a streaming kernel was renamed: update STREAMING"
    assert {f: counts[f] for f in STREAMING if counts[f] == 0} == {}
