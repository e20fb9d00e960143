"""The server's log lines: uvicorn's levels, and llmc's own loggers printed beside uvicorn's (no heavy imports:
the CLI reads `LogLevel` for its `--log-level` choices)."""

from __future__ import annotations

import logging
from enum import Enum

from llmc.errors import InputError


class LogLevel(str, Enum):
    """uvicorn's log levels (`--log-level`), which llmc's own lines follow too."""

    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"

    @property
    def number(self) -> int:
        return 5 if self is LogLevel.trace else int(logging.getLevelName(self.value.upper()))  # uvicorn's TRACE: 5


def log_level_of(level: LogLevel | str) -> LogLevel:
    try:
        return LogLevel(level.lower())  # (a LogLevel is a str: its value lowered)
    except ValueError:
        raise InputError(f"log level must be one of {', '.join(v.value for v in LogLevel)}, got {level!r}",
                         "log_level") from None


def show_llmc_logs(level: LogLevel | str = "info") -> logging.Handler:
    """llmc's own loggers (`llmc.runtime`, `llmc.serve`: start-up facts, a request ended by a fault) print to stderr
    beside uvicorn's lines, in its format, at the server's level; without a handler only warnings and errors showed,
    as bare messages. Added once per process; returns the handler."""
    logger = logging.getLogger("llmc")
    for handler in logger.handlers:
        if getattr(handler, "llmc_server", False):
            break
    else:
        from uvicorn.logging import DefaultFormatter

        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=False))
        handler.llmc_server = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(log_level_of(level).number)
    return handler
