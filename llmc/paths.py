"""Where llmc keeps what it makes once per machine (exports, engines, checks): $LLMC_CACHE, else ~/.cache/llmc."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("LLMC_CACHE", Path.home() / ".cache" / "llmc"))
