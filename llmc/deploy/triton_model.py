"""Triton Inference Server Python-backend model: llmc's runtime behind Triton (copied as `<model>/1/model.py`).

Decoupled: every request streams its text as responses and ends with one flagged final. All requests share one
`AsyncEngine` (one engine thread, continuous batching), driven from an asyncio loop of this model's own.
Inputs: text_input (the prompt, or with chat=true the user message), and optional max_tokens, temperature,
top_p, top_k, seed, chat. Outputs per response: text_output (new text), finish_reason ("" until the last).
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # Triton's Python backend provides it (tests: a stand-in)

from llmc.errors import InputError, LlmcError
from llmc.runtime.async_engine import AsyncEngine, AsyncEngineConfig
from llmc.runtime.config import SERVE_STEP_TOKENS, RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.runtime.request import SamplingParams

_SAMPLING = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}
_KINDS = {int: (np.integer, "an integer"), float: (np.integer | np.floating, "a number")}


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        folder = Path(args["model_repository"]) / args["model_version"] / params.get("engine_dir", "engine")
        runtime = RuntimeConfig(threads=_int_param(params, "threads", 0, 0),
                                kv_budget_mb=_int_param(params, "kv_budget_mb", 1024, 1),
                                max_running=_int_param(params, "max_running", 8, 1, SERVE_STEP_TOKENS),
                                max_step_tokens=SERVE_STEP_TOKENS,
                                kv_prefault=True)
        queue = AsyncEngineConfig(max_queue=_int_param(params, "max_queue", 64, 0))  # every parameter checked first
        self.llm = LLM(folder, runtime)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llmc-triton-loop", daemon=True)
        self.thread.start()
        self.engine = AsyncEngine(self.llm.loop, queue)
        self.pending: set[Any] = set()

    def execute(self, requests: list[Any]) -> None:
        """Queue each request on the engine and return at once (decoupled: responses go through the senders)."""
        for request in requests:
            future = asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)
            self.pending.add(future)
            future.add_done_callback(self.pending.discard)
        return None

    async def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            await self._stream(request, sender)
        except Exception as e:  # never a request left without its final response (its client would wait forever)
            err = pb_utils.TritonError(f"llmc failed: {type(e).__name__}: {e}")
            try:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                pass  # its final response was sent already

    async def _stream(self, request: Any, sender: Any) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            ids, params = self._parse(request)
            stream = self.engine.add_request(ids, params)
        except LlmcError as e:  # a bad request or an overloaded engine: one error response, final
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))), flags=final)
            return
        try:
            async for u in stream:
                if sender.is_cancelled():
                    break
                if u.finish_reason is not None and u.finish_reason.value in ("error", "abort"):
                    err = pb_utils.TritonError(f"the request ended with {u.finish_reason.value}")
                    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err), flags=final)
                    return
                reason = u.finish_reason.value if u.finish_reason is not None else ""
                sender.send(_response(u.text, reason), flags=final if u.finish_reason is not None else 0)
                if u.finish_reason is not None:
                    return
            sender.send(flags=final)  # cancelled: end the stream with no more text
        finally:
            stream.close()

    def _parse(self, request: Any) -> tuple[list[int], SamplingParams]:
        raw = _scalar(request, "text_input")
        if raw is None:
            raise InputError("input 'text_input' is required", "text_input")
        try:
            text = raw.decode() if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as e:
            raise InputError(f"input 'text_input' is not UTF-8 text: {e.reason} at byte {e.start}",
                             "text_input") from None
        if not isinstance(text, str):
            raise InputError(f"input 'text_input' must be a string (TYPE_STRING), got {type(raw).__name__}",
                             "text_input")
        values: dict[str, Any] = {}
        for name, cast in _SAMPLING.items():
            value = _scalar(request, name)
            if value is not None:
                kinds, what = _KINDS[cast]
                if isinstance(value, np.bool_) or not isinstance(value, kinds):
                    raise InputError(f"input {name!r} must be {what}, got {_shown(value)!r}", name)
                values[name] = cast(value)
        chat = _scalar(request, "chat")
        if chat is not None and not isinstance(chat, np.bool_ | bool):
            raise InputError(f"input 'chat' must be a bool (TYPE_BOOL), got {_shown(chat)!r}", "chat")
        if chat:
            ids = self.llm.encode_chat([{"role": "user", "content": text}])
        else:
            ids = self.llm.tokenizer.encode(text, add_special_tokens=True)
        values.setdefault("max_tokens", max(1, min(256, self.llm.max_context - len(ids))))
        params = SamplingParams(**values)
        return ids, params

    def finalize(self) -> None:
        asyncio.run_coroutine_threadsafe(self.engine.shutdown(5.0), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _int_param(params: dict[str, str], name: str, default: int, low: int, high: int | None = None) -> int:
    """An integer of config.pbtxt's `parameters`, checked: a bad one fails loading the model, naming it."""
    text = params.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"config.pbtxt parameter {name!r} must be an integer, got {text!r}") from None
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InputError(f"config.pbtxt parameter {name!r} must be {bounds}, got {value}")
    return value


def _scalar(request: Any, name: str) -> Any:
    """The one value of input `name` (None when the request does not have it)."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    raw = t.as_numpy().reshape(-1)
    if raw.size != 1:
        raise InputError(f"input {name!r} must hold 1 value, got {raw.size}", name)
    return raw[0]


def _shown(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _response(text: str, finish_reason: str) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_))])
