"""The `llmc` command line (Typer). Each command parses flags, builds a config and calls one function."""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from llmc import __version__
from llmc.errors import LlmcError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Compile Hugging Face decoder-only LLMs into prefill + decode engines and run them.")

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """A user's mistake is one line on stderr and exit code 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LlmcError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(code=1) from None
        except KeyboardInterrupt as e:
            terminated = isinstance(e, Terminated)
            typer.echo("terminated" if terminated else "interrupted", err=True)
            raise typer.Exit(code=143 if terminated else 130) from None

    return wrapper  # type: ignore[return-value]


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"llmc {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """llmc: export -> build -> run."""
    if threading.current_thread() is threading.main_thread():  # (signal handlers belong to the main thread)
        signal.signal(signal.SIGTERM, _terminated)  # (llmc serve's server installs its own when it starts)


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, a pipeline's timeout, a container stopping) ends a command as Ctrl-C does: its partial output
    folder and temporary files are removed on the way out, not left behind; exit code 143 (128 + SIGTERM)."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated


COMMAND_MODULES = ("export_cmd", "build_cmd", "run_cmd", "verify_cmd", "bench_cmd", "serve_cmd", "deploy_cmd")


def _register() -> None:
    import importlib
    import importlib.util

    for name in COMMAND_MODULES:
        if importlib.util.find_spec(f"llmc.cli.{name}") is not None:
            importlib.import_module(f"llmc.cli.{name}").register(app, user_errors)


_register()

if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
