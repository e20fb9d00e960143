"""llmc on Ray Serve, on loopback with a local Ray cluster started here (one for the module): 2 engine replicas of
1 thread each behind the OpenAI-compatible ingress, on the tiny engine and on SmolLM2."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray import serve  # the ray extra (`make install` installs it: missing is a failure, not a skip)

from llmc.deploy import ray_app
from llmc.deploy.ray_settings import RayAppConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster with Serve's HTTP proxy on a free loopback port; yields the base URL."""
    import ray

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="llmc-tests")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    ray_app.shutdown()
    assert not ray.is_initialized()


def _deploy(engine_dir: Path, **kw: Any) -> None:
    cfg = RayAppConfig(engine_dir=str(engine_dir), replicas=2, threads=1, kv_budget_mb=128, model_name="m", **kw)
    ray_app.deploy(cfg)


def _undeploy() -> None:
    """Delete the app; it shuts down cleanly: no replica actor is left."""
    import ray

    serve.delete(ray_app.APP_NAME)
    assert ray_app.APP_NAME not in serve.status().applications
    left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{ray_app.APP_NAME}#")]
    assert not left, left


def replica_metrics(url: str) -> dict[str, dict[str, float]]:
    """{metric: {replica: value}} for the per-replica counters on the ingress's /metrics."""
    out: dict[str, dict[str, float]] = {}
    for m in re.finditer(r'^(llmc_replica_\w+)_total\{replica="([^"]+)"\} (\S+)$', httpx.get(url + "/metrics").text,
                         re.M):
        out.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))
    return out


def _client(url: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def _stream_chat(client: Any, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=0, stream=True)
    text, reason = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.fixture(scope="module")
def tiny_app(cluster: str, deploy_engine_dir: Path) -> Iterator[str]:
    _deploy(deploy_engine_dir)
    yield cluster
    _undeploy()


def test_32_concurrent_streams_spread_over_both_replicas(tiny_app: str) -> None:
    before = replica_metrics(tiny_app)

    async def run() -> list[tuple[str, str | None]]:
        client = _client(tiny_app)
        return await asyncio.gather(*[_stream_chat(client, f"Tell me about {i}", 12) for i in range(32)])

    results = asyncio.run(run())
    assert all(reason == "length" and text for text, reason in results)
    after = replica_metrics(tiny_app)
    served = {r: n - before.get("llmc_replica_requests", {}).get(r, 0)
              for r, n in after["llmc_replica_requests"].items()}
    assert sum(served.values()) == 32
    assert len([r for r, n in served.items() if n > 0]) == 2, f"one replica served everything: {served}"
    tokens = {r: n - before.get("llmc_replica_generation_tokens", {}).get(r, 0)
              for r, n in after["llmc_replica_generation_tokens"].items()}
    assert sum(tokens.values()) == 32 * 12


_BAD = [
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}),
    ("/v1/completions", {"prompt": "hi", "temperature": -2}),
    ("/v1/completions", {"prompt": "hi", "n": 10**4}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", "{not json"),
]


def test_same_validation_and_error_format_as_llmc_serve(tiny_app: str, deploy_engine_dir: Path) -> None:
    from fastapi.testclient import TestClient

    from llmc.runtime.config import RuntimeConfig
    from llmc.serve.app import ServeConfig, create_app

    # the replicas' settings, in one local `llmc serve` app
    local = create_app(deploy_engine_dir, ServeConfig(model_name="m", max_queue=16, runtime=RuntimeConfig(
        threads=1, kv_budget_mb=128, max_step_tokens=512)))
    with TestClient(local) as client:
        for path, body in _BAD:
            kw: dict[str, Any] = {"content": body, "headers": {"Content-Type": "application/json"}} \
                if isinstance(body, str) else {"json": body}
            want = client.post(path, **kw)
            got = httpx.post(tiny_app + path, timeout=30, **kw)
            assert 400 <= want.status_code < 500, want.text
            assert (got.status_code, got.json()) == (want.status_code, want.json()), (path, body)
        assert httpx.get(tiny_app + "/v1/models").json()["data"][0]["max_model_len"] == \
            client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert httpx.get(tiny_app + "/health").status_code == 200
    page = httpx.get(tiny_app + "/")  # the chat page comes with llmc's routes
    assert page.status_code == 200 and "static/chat.js" in page.text


def _engine_deployment(cfg: RayAppConfig) -> Any:
    """The engine deployment the app binds (the ingress's first argument), as Ray Serve will run it."""
    return ray_app.build_app(cfg)._bound_deployment.init_args[0]._bound_deployment


def test_replica_count_and_autoscaling_go_to_ray_serve() -> None:
    fixed = _engine_deployment(RayAppConfig(engine_dir="/e", replicas=3, threads=2, max_running=4, max_queue=6))
    assert (fixed.name, fixed.num_replicas, fixed.ray_actor_options) == ("LLMEngine", 3, {"num_cpus": 2})
    assert (fixed.max_ongoing_requests, fixed.max_queued_requests) == (10, 256)  # a replica's capacity
    assert fixed._deployment_config.autoscaling_config is None
    auto = _engine_deployment(RayAppConfig(engine_dir="/e", replicas=2, min_replicas=1, max_replicas=5,
                                           target_ongoing_requests=3))
    a = auto._deployment_config.autoscaling_config
    assert (a.min_replicas, a.initial_replicas, a.max_replicas, a.target_ongoing_requests) == (1, 2, 5, 3.0)


def test_a_replica_that_cannot_start_is_a_one_line_error(cluster: str, deploy_engine_dir: Path,
                                                          tmp_path: Path) -> None:
    import shutil

    from llmc.errors import LlmcError

    broken = tmp_path / "engine"
    shutil.copytree(deploy_engine_dir, broken)
    (broken / "weights.bin").write_bytes(b"")
    with pytest.raises(LlmcError, match=r"Ray Serve could not deploy .*: LLMEngine: .*weights\.bin") as e:
        _deploy(broken)
    assert "\n" not in str(e.value)
    assert ray_app.APP_NAME not in serve.status().applications


@pytest.mark.slow
def test_smollm2_answers_and_survives_a_killed_replica(cluster: str, smollm2: Any) -> None:
    import openai
    import ray

    _deploy(smollm2.engine_dir, max_running=8)
    try:
        text, _ = asyncio.run(_stream_chat(_client(cluster), "What is the capital of France?", 16))
        assert "Paris" in text

        async def run() -> list[Any]:
            client = _client(cluster)
            tasks = [asyncio.create_task(_stream_chat(client, f"Write a story about the number {i}.", 64))
                     for i in range(32)]
            deadline = time.monotonic() + 60
            while True:  # once both replicas generate, kill the one with the most requests
                tokens = replica_metrics(cluster).get("llmc_replica_generation_tokens", {})
                if len([n for n in tokens.values() if n > 0]) >= 2 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            requests = replica_metrics(cluster)["llmc_replica_requests"]
            victim = max(requests, key=requests.get)  # type: ignore[arg-type]
            actor = ray.get_actor(f"SERVE_REPLICA::{ray_app.APP_NAME}#LLMEngine#{victim}", namespace="serve")
            ray.kill(actor, no_restart=True)
            return [victim, *await asyncio.gather(*tasks, return_exceptions=True)]

        victim, *results = asyncio.run(asyncio.wait_for(run(), 180))
        failed = [r for r in results if isinstance(r, BaseException)]
        done = [r for r in results if not isinstance(r, BaseException)]
        assert failed and done, f"{len(failed)} failed, {len(done)} completed"
        for e in failed:  # a clean error: the server's error event, not a hang or a cut connection
            assert isinstance(e, openai.APIError), repr(e)
            assert "the engine failed while generating this request" in str(e), str(e)
        assert all(reason == "length" for _, reason in done)

        deadline = time.monotonic() + 90  # Ray Serve replaces the dead replica
        while time.monotonic() < deadline:
            states = serve.status().applications[ray_app.APP_NAME].deployments["LLMEngine"].replica_states
            if states.get("RUNNING") == 2:
                break
            time.sleep(0.5)
        assert states.get("RUNNING") == 2, states

        async def after() -> list[tuple[str, str | None]]:
            client = _client(cluster)
            return await asyncio.gather(*[_stream_chat(client, f"Say {i}", 8) for i in range(8)])

        assert all(reason == "length" for _, reason in asyncio.run(after()))
        live = replica_metrics(cluster)["llmc_replica_requests"]
        assert len(live) == 3 and victim in live  # the victim's counts stay; the new replica has its own
    finally:
        _undeploy()
