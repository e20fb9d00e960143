"""User-facing errors. Each message is one line that names the value and the limit."""

from __future__ import annotations


class LlmcError(Exception):
    """Base of every error a user can cause; the CLI prints it on one line and exits 1."""


class InputError(LlmcError):
    """A bad argument, path, or request field; `param` names the request field at fault, when there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedModelError(LlmcError):
    """The model's architecture or format is not one llmc can export."""


class ManifestError(LlmcError):
    """A manifest is missing, of another format version, or does not match its files."""


class LimitError(InputError):
    """A request exceeds a limit of the engine (context length, batch size, ...)."""


class BackendUnavailableError(LlmcError):
    """A backend's library or hardware is not present on this machine."""


class EngineError(LlmcError):
    """An engine failed while running a request."""


def one_line(text: object, limit: int = 300) -> str:
    """An exception's (or any) text on one line, its whitespace runs as single spaces, cut at `limit` characters:
    how a message from a library goes into one of llmc's."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."
