"""Run the app under uvicorn with the shutdown docs/serving.md describes.

SIGTERM (or Ctrl-C): uvicorn stops accepting connections and lets in-flight responses finish for up to
`shutdown_timeout` seconds, cancels what is left, then the app's lifespan stops the engine. The process exits 0.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType

from llmc.runtime.llm import LLM
from llmc.serve.app import ServeConfig, create_app
from llmc.serve.logs import LogLevel, log_level_of, show_llmc_logs


def _ignore(signum: int, frame: FrameType | None) -> None:
    """uvicorn re-raises the signal it shut down on once it is done; this makes that a no-op (exit 0)."""


def run_server(source: LLM | str | Path, config: ServeConfig, log_level: LogLevel | str = "info") -> None:
    """Serve until SIGTERM/SIGINT; blocks. Call from the main thread (signal handlers)."""
    import uvicorn

    level = log_level_of(log_level)
    show_llmc_logs(level)
    app = create_app(source, config)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=level.value,
                               timeout_graceful_shutdown=max(1, round(config.shutdown_timeout)),
                               timeout_keep_alive=5)
    server = uvicorn.Server(uv_config)
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
