"""A stand-in for Triton's `triton_python_backend_utils` (the Python backend's module), with the API a decoupled
model uses and the rules Triton enforces: a response sender refuses anything after the final flag, tensors carry
numpy arrays, a request's inputs are found by name (None for an absent optional one).

`Request` plays the server's side: it records what the model sends, and can be cancelled by the client.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonModelException(Exception):
    """What Triton's Python backend raises for a misused API (the stand-in raises it the same way)."""


class TritonError:
    def __init__(self, message: str, code: int | None = None) -> None:
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        if not isinstance(array, np.ndarray):
            raise TritonModelException(f"Tensor {name!r} needs a numpy array, got {type(array).__name__}")
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        for t in output_tensors or []:
            if not isinstance(t, Tensor):
                raise TritonModelException(f"output_tensors must hold Tensors, got {type(t).__name__}")
        self._outputs, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class ResponseSender:
    def __init__(self, request: Request) -> None:
        self._request = request

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        r = self._request
        with r.lock:
            if r.closed:
                raise TritonModelException("Unable to send a response: the final flag was already sent")
            if response is None and flags != TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                raise TritonModelException("a response without the final flag needs a response object")
            if response is not None:
                r.responses.append(response)
            if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                r.closed = True
                r.done.set()

    def is_cancelled(self) -> bool:
        return self._request.cancelled


class Request:
    """A client's request as the model sees it (InferenceRequest), plus what the model sent back."""

    def __init__(self, request_id: str, inputs: dict[str, np.ndarray]) -> None:
        self._id = request_id
        self._inputs = [Tensor(k, v) for k, v in inputs.items()]
        self.responses: list[InferenceResponse] = []
        self.closed = False
        self.cancelled = False
        self.done = threading.Event()
        self.lock = threading.Lock()
        self._sender: ResponseSender | None = None

    def request_id(self) -> str:
        return self._id

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def get_response_sender(self) -> ResponseSender:
        if self._sender is None:
            self._sender = ResponseSender(self)
        return self._sender

    def is_cancelled(self) -> bool:
        return self.cancelled

    def texts(self) -> list[str]:
        return [_output(r, "text_output") for r in self.responses if not r.has_error()]

    def finish_reason(self) -> str:
        ok = [r for r in self.responses if not r.has_error()]
        return _output(ok[-1], "finish_reason") if ok else ""


def _output(response: InferenceResponse, name: str) -> str:
    t = next(t for t in response.output_tensors() if t.name() == name)
    value: Any = t.as_numpy().reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def get_input_tensor_by_name(request: Request, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)
