"""The FastAPI app: OpenAI-compatible endpoints over one `AsyncEngine` (docs/serving.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from llmc import __version__
from llmc.runtime.async_engine import AsyncEngine, AsyncEngineConfig
from llmc.runtime.config import SERVE_STEP_TOKENS, RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.runtime.tool_calls import ToolFormat
from llmc.serve import chat_page
from llmc.serve.chat import create_chat_completion
from llmc.serve.completions import create_completion
from llmc.serve.context import Served
from llmc.serve.errors import install_error_handlers
from llmc.serve.middleware import Guard, GuardConfig
from llmc.serve.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList


@dataclass(frozen=True)
class ServeConfig:
    """How `llmc serve` runs one engine; built once by the CLI. `runtime`: how the engine runs (by default small
    prompt chunks per step, which keep running streams' inter-token latency low, and the KV budget mapped at
    start-up)."""

    model_name: str | None = None  # what clients pass as `model`; None: the engine folder's name
    host: str = "127.0.0.1"
    port: int = 8000
    runtime: RuntimeConfig = RuntimeConfig(max_step_tokens=SERVE_STEP_TOKENS, kv_prefault=True)
    max_queue: int = 64  # sequences waiting beyond the running ones; past it: 429
    shutdown_timeout: float = 30.0  # SIGTERM: seconds to drain in-flight requests
    retry_after_s: float = 1.0
    api_key: str | None = None  # required as `Authorization: Bearer KEY` on /v1/* when set
    protect_metrics: bool = False  # /metrics behind the key too
    allowed_origins: tuple[str, ...] = ()  # CORS: off unless origins are named ("*" for any)
    max_request_bytes: int = 2 * 2**20  # larger bodies: 413 before they are read
    tool_call_parser: ToolFormat | None = None  # the model's tool call format; None: the chat template's

    def guard_config(self) -> GuardConfig:
        return GuardConfig(api_key=self.api_key, protect_metrics=self.protect_metrics,
                           max_request_bytes=self.max_request_bytes)


def create_app(source: LLM | str | Path, config: ServeConfig | None = None) -> FastAPI:
    """An app serving `source` (a loaded `LLM`, or an engine folder loaded here with `config.runtime`).

    The app owns the LLM's engine loop from here on (one engine thread); do not call `LLM.generate` meanwhile.
    A given `LLM` keeps its own runtime config (`config.runtime` is used only to load a folder). The engine stops
    at the app's shutdown, after draining for `config.shutdown_timeout` seconds.
    """
    config = config or ServeConfig()
    llm = source if isinstance(source, LLM) else LLM(source, config.runtime)
    engine = AsyncEngine(llm.loop, AsyncEngineConfig(config.max_queue, config.retry_after_s))
    served = Served(engine, llm.tokenizer, config.model_name or llm.engine_dir.name, str(llm.engine_dir),
                    config.tool_call_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown(config.shutdown_timeout)

    app = FastAPI(title="llmc", version=__version__, lifespan=lifespan)
    app.state.served = served
    app.state.engine = engine
    install_error_handlers(app)
    app.add_middleware(Guard, config=config.guard_config())
    if config.allowed_origins:  # outside the guard: a CORS preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["Authorization", "Content-Type"],
                           expose_headers=["X-Request-Id"])
    _routes(app, served)
    return app


def _routes(app: FastAPI, served: Served) -> None:
    chat_page.install(app)  # GET /: the chat page

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(served, req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(served, req, raw)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served.model_name, root=served.root,
                                         max_model_len=served.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        ok = served.engine.alive and served.engine.accepting
        return Response(status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
