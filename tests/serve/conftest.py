"""Fixtures for the server tests: a tiny Llama engine, and servers started on loopback in a thread."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmc.errors import EngineError
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.serve.app import ServeConfig, create_app

MODEL = "tiny"


class Server:
    """An app served by uvicorn in a background thread on a free loopback port."""

    def __init__(self, llm: LLM, config: ServeConfig) -> None:
        import uvicorn

        self.app, self.llm = create_app(llm, config), llm
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        uv = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=round(config.shutdown_timeout))
        self.server = uvicorn.Server(uv)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.02)
        raise RuntimeError("server did not start")

    @property
    def engine(self) -> Any:
        return self.app.state.engine

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{labels}': value} (labels as the exposition prints them)."""
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(\w+)(\{[^}]*\})? (\S+)$", line)
            if m:
                labels = re.sub(r',?model_name="[^"]*"', "", m.group(2) or "").replace("{,", "{")
                out[m.group(1) + ("" if labels in ("", "{}") else labels)] = float(m.group(3))
        return out

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no sequence runs or waits and the KV cache is empty."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.running == 0 and s.waiting == 0 and s.kv_used_tokens == 0:
                return
            time.sleep(0.01)
        raise AssertionError(f"engine not idle after {timeout}s: {self.engine.stats()}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def slow_down(llm: LLM, seconds: float) -> None:
    """Make every decode step take at least `seconds` (long requests for disconnect/backpressure/drain tests)."""
    decode = llm.engine.decode

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return decode(*args, **kwargs)

    llm.engine.decode = slow  # type: ignore[method-assign]


def fail_prefill_on(llm: LLM, marker: int, exc: type[Exception] = EngineError) -> None:
    """Make prefill raise `exc` for any batch with a prompt that holds token `marker`."""
    prefill = llm.engine.prefill

    def failing(slots: list[int], prompts: list[list[int]], kv: Any, **kwargs: Any) -> Any:
        if any(marker in p for p in prompts):
            raise exc(f"injected failure for token {marker}")
        return prefill(slots, prompts, kv, **kwargs)

    llm.engine.prefill = failing  # type: ignore[method-assign]


ServerFactory = Callable[..., Server]


@pytest.fixture
def start_server(serve_engine_dir: Path) -> Iterator[ServerFactory]:
    """start_server(config=..., setup=fn(llm)) -> a running Server, stopped after the test."""
    started: list[Server] = []

    def start(config: ServeConfig | None = None, setup: Callable[[LLM], None] | None = None) -> Server:
        config = config or ServeConfig(model_name=MODEL, max_queue=16, runtime=RuntimeConfig(max_running=4, threads=1))
        llm = LLM(serve_engine_dir, config.runtime)
        if setup is not None:
            setup(llm)
        server = Server(llm, config)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def server(serve_engine_dir: Path) -> Iterator[Server]:
    """A default server shared by a module's tests (4 slots, queue of 16)."""
    config = ServeConfig(model_name=MODEL, max_queue=16, runtime=RuntimeConfig(max_running=4, threads=1))
    llm = LLM(serve_engine_dir, config.runtime)
    s = Server(llm, config)
    yield s
    s.stop()
