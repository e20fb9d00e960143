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

from llmc.errors import LlmcError
from llmc.runtime.async_engine import AsyncEngine, AsyncEngineConfig
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.runtime.request import SamplingParams

_SAMPLING = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        folder = Path(args["model_repository"]) / args["model_version"] / params.get("engine_dir", "engine")
        runtime = RuntimeConfig(threads=int(params.get("threads", 0)), kv_budget_mb=int(params.get("kv_budget_mb", 1024)),
                                max_running=int(params.get("max_running", 8)), max_step_tokens=512,
                                kv_prefault=True)
        self.llm = LLM(folder, runtime)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llmc-triton-loop", daemon=True)
        self.thread.start()
        self.engine = AsyncEngine(self.llm.loop, AsyncEngineConfig(max_queue=int(params.get("max_queue", 64))))
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
        text_in = pb_utils.get_input_tensor_by_name(request, "text_input")
        if text_in is None:
            raise LlmcError("input 'text_input' is required")
        raw = text_in.as_numpy().reshape(-1)
        if raw.size != 1:
            raise LlmcError(f"input 'text_input' must hold 1 string, got {raw.size}")
        text = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
        values: dict[str, Any] = {}
        for name, cast in _SAMPLING.items():
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None:
                values[name] = cast(t.as_numpy().reshape(-1)[0])
        chat = pb_utils.get_input_tensor_by_name(request, "chat")
        if chat is not None and bool(chat.as_numpy().reshape(-1)[0]):
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


def _response(text: str, finish_reason: str) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_))])
