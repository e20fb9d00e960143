"""Run the app under uvicorn with the shutdown docs/serving.md describes.

SIGTERM (or Ctrl-C): uvicorn stops accepting connections and lets in-flight responses finish for up to
`shutdown_timeout` seconds, cancels what is left, then the app's lifespan stops the engine. The process exits 0.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType

from llmc.runtime.llm import LLM
from llmc.serve.app import ServeConfig, create_app


def _ignore(signum: int, frame: FrameType | None) -> None:
    """uvicorn re-raises the signal it shut down on once it is done; this makes that a no-op (exit 0)."""


def show_llmc_logs(level: str = "info") -> logging.Handler:
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
    logger.setLevel(level.upper())
    return handler


def run_server(source: LLM | str | Path, config: ServeConfig, log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT; blocks. Call from the main thread (signal handlers)."""
    import uvicorn

    show_llmc_logs(log_level)
    app = create_app(source, config)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                               timeout_graceful_shutdown=max(1, round(config.shutdown_timeout)),
                               timeout_keep_alive=5)
    server = uvicorn.Server(uv_config)
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
