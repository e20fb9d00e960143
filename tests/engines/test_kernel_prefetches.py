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

import pytest

from llmc.engines.kernels import library_path

STREAMING = ("attend_avx512", "unit_vnni", "unit_avx2", "unit_avx512", "unit_f512")


def _prefetches_per_function() -> Counter[str]:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump (binutils) to read the library's machine code")
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
    missing = [f for f in STREAMING if f not in seen]
    if len(missing) == len(STREAMING):
        pytest.skip("the library carries no local symbols (stripped): its kernels cannot be told apart")
    assert not missing, f"kernels not found in {library_path().name}: {missing} (renamed? update STREAMING)"
    return counts


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 kernels only")
def test_every_streaming_kernel_prefetches() -> None:
    counts = _prefetches_per_function()
    assert {f: counts[f] for f in STREAMING if counts[f] == 0} == {}
