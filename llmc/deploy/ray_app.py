"""llmc on Ray Serve: an OpenAI-compatible ingress (the same routes, request checks and error format as
`llmc serve`: the same code) in front of N engine replicas, each one engine with its own continuous batching.

Ray Serve's router spreads requests over the replicas (at most max_running + max_queue in flight on each),
restarts a replica that dies or fails its health check, and scales the count between the autoscaling bounds on
requests in flight. `build_app` is also the import path of a Ray Serve config file (`llmc package --target ray`).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from llmc import __version__
from llmc.deploy.ray_settings import RayAppConfig
from llmc.deploy.remote_engine import EngineFacts, RemoteEngine
from llmc.errors import InputError, LlmcError
from llmc.runtime.async_engine import AsyncEngine, AsyncEngineConfig, OverloadedError, ShuttingDownError
from llmc.runtime.request import SamplingParams

APP_NAME = "llmc"


# an engine folder that fails to load fails again: two tries, then the deployment fails with the cause
@serve.deployment(name="LLMEngine", health_check_period_s=2, health_check_timeout_s=10,
                  max_constructor_retry_count=2, graceful_shutdown_timeout_s=20)
class EngineReplica:
    """One engine and its engine thread; streams each request's updates as ("start", replica id), then
    ("update", StreamUpdate)..., or ("error", (kind, message, param, retry_after)) when refused."""

    def __init__(self, cfg: RayAppConfig) -> None:
        from llmc.runtime.llm import LLM

        self.llm = LLM(cfg.engine_dir, cfg.runtime())
        self.engine = AsyncEngine(self.llm.loop, AsyncEngineConfig(cfg.max_queue))
        self.replica = serve.get_replica_context().replica_id.unique_id

    def facts(self) -> EngineFacts:
        loop = self.llm.loop
        engine = self.llm.engine
        return EngineFacts(loop.max_len, loop.max_running, self.engine.config.max_queue, engine.vocab_size,
                           engine.logits_size, tuple(loop.eos_ids), self.engine.stats().kv_capacity_tokens)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[tuple[str, Any]]:
        try:
            stream = self.engine.add_request(prompt_ids, params)
        except LlmcError as e:
            yield "error", _error_values(e)
            return
        yield "start", self.replica
        try:
            async for u in stream:
                yield "update", u
        finally:  # done, or cancelled by the ingress (client gone): free the KV slot now
            stream.close()

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine thread has stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


def _error_values(e: LlmcError) -> tuple[str, str, str | None, float]:
    if isinstance(e, ShuttingDownError):
        return "shutting_down", str(e), None, e.retry_after
    if isinstance(e, OverloadedError):
        return "overloaded", str(e), None, e.retry_after
    if isinstance(e, InputError):
        return "input", str(e), e.param, 0.0
    return "engine", str(e), None, 0.0


@serve.deployment(name="LLMIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """HTTP: llmc's own FastAPI routes over a `RemoteEngine` (tokenizing and checking here, generating there)."""

    async def __init__(self, engine: DeploymentHandle, cfg: RayAppConfig) -> None:  # type: ignore[misc]  # Ray Serve awaits it
        from pathlib import Path

        from llmc.runtime.tokenizer import Tokenizer

        self.cfg = cfg
        self.handle = engine.options(stream=False)
        self.facts = await engine.facts.remote()
        self.tokenizer = Tokenizer.from_dir(cfg.engine_dir, cfg.chat_template)
        self.model_name = cfg.model_name or Path(cfg.engine_dir).resolve().name

    def __serve_build_asgi_app__(self) -> FastAPI:
        return ingress_app(self.handle, self.facts, self.tokenizer, self.model_name, self.cfg)


def ingress_app(handle: Any, facts: EngineFacts, tokenizer: Any, model_name: str, cfg: RayAppConfig) -> FastAPI:
    """`llmc.serve.app`'s app, assembled around a `RemoteEngine` instead of a local one."""
    from llmc.deploy.remote_engine import ReplicaMetrics
    from llmc.serve.app import ServeConfig, _routes
    from llmc.serve.context import Served
    from llmc.serve.errors import install_error_handlers
    from llmc.serve.middleware import Guard

    engine = RemoteEngine(handle, facts, tokenizer)
    served = Served(cast(AsyncEngine, engine), tokenizer, model_name, cfg.engine_dir)
    engine.metrics = ReplicaMetrics(served.metrics.registry)  # one registry: one /metrics
    app = FastAPI(title="llmc", version=__version__)
    app.state.served, app.state.engine = served, engine
    install_error_handlers(app)
    app.add_middleware(Guard, config=ServeConfig(api_key=cfg.api_key).guard_config())
    _routes(app, served)
    return app


def build_app(args: dict[str, Any] | RayAppConfig) -> Any:
    """The Ray Serve application (`serve run` import path: `llmc.deploy.ray_app:build_app`)."""
    cfg = args if isinstance(args, RayAppConfig) else RayAppConfig.from_args(dict(args))
    engine_opts: dict[str, Any] = {
        "max_ongoing_requests": cfg.capacity, "max_queued_requests": cfg.max_queued_requests,
        "ray_actor_options": {"num_cpus": cfg.threads}}
    auto = cfg.autoscaling_config()
    if auto is not None:
        engine_opts["autoscaling_config"] = auto
    else:
        engine_opts["num_replicas"] = cfg.replicas
    replicas = cast(Any, EngineReplica).options(**engine_opts).bind(cfg)  # serve.deployment made them Deployments
    return cast(Any, Ingress).bind(replicas, cfg)


def start(cfg: RayAppConfig, host: str, port: int, address: str | None = None) -> None:
    """Connect to (or start) a Ray cluster and deploy the app; returns once every replica is up."""
    connect(address)
    serve.start(http_options={"host": host, "port": port})
    deploy(cfg)


def connect(address: str | None = None) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 namespace="llmc", log_to_driver=False)


def deploy(cfg: RayAppConfig) -> None:
    """Run the app on the connected cluster (blocks until it is up); a replica that cannot start (a bad engine
    folder, too little memory) is a one-line error naming its cause, after the app is deleted."""
    try:
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as e:
        cause = _failure(str(e))
        serve.delete(APP_NAME)
        raise LlmcError(f"Ray Serve could not deploy {cfg.engine_dir}: {cause}") from None


def _failure(fallback: str) -> str:
    """The last line of a failed deployment's message: the exception its replica raised."""
    status = serve.status().applications.get(APP_NAME)
    for name, d in (status.deployments.items() if status else ()):
        lines = [x.strip() for x in (d.message or "").splitlines() if x.strip()]
        if d.status.value == "DEPLOY_FAILED" and lines:
            return f"{name}: {lines[-1]}"
    return fallback.splitlines()[-1] if fallback else "unknown error"


def run_until_signal(cfg: RayAppConfig, host: str, port: int, address: str | None = None) -> None:
    """`llmc deploy ray`: deploy, serve until SIGTERM/SIGINT, then delete the app and stop Serve (exit 0)."""
    stop = threading.Event()
    starting = True

    def on_signal(*_: Any) -> None:
        stop.set()
        if starting:  # still waiting for the replicas: stop waiting (the app is deleted below)
            raise KeyboardInterrupt

    connect(address)  # Ray installs signal handlers of its own: ours go after
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        start(cfg, host, port, address)
        starting = False
        count = f"{cfg.min_replicas or 1}-{cfg.max_replicas} replicas" if cfg.autoscaling else f"{cfg.replicas} replicas"
        print(f"llmc on Ray Serve: http://{host}:{port} ({count}); SIGTERM or Ctrl-C to stop", file=sys.stderr,
              flush=True)
        stop.wait()
    finally:
        shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def shutdown() -> None:
    import ray

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
