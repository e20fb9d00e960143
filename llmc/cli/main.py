"""The `llmc` command line (Typer). Each command parses flags, builds a config and calls one function."""

from __future__ import annotations

import functools
import sys
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
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(code=130) from None

    return wrapper  # type: ignore[return-value]


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"llmc {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """llmc: export -> build -> run."""


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
