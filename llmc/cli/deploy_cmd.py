"""`llmc package ENGINE_DIR --target ...`: deployable artifacts; `llmc deploy ray ENGINE_DIR`: scale out on Ray
Serve (an OpenAI-compatible ingress and N engine replicas)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from llmc.cli.common import ChatTemplate
from llmc.deploy.package import Target


def register(app: typer.Typer, wrap: Any) -> None:
    @app.command("package")
    @wrap
    def package_command(
        engine_dir: Annotated[Path, typer.Argument(help="Engine folder (from `llmc build`).")],
        target: Annotated[Target, typer.Option(help="What to write: a Docker build context, a Triton model "
                                                    "repository, KServe/Kubernetes manifests, a Ray Serve config.")],
        out: Annotated[Path, typer.Option("-o", "--out", help="Output folder.")],
        force: Annotated[bool, typer.Option(help="Replace a non-empty output folder.")] = False,
        name: Annotated[str | None, typer.Option(help="Served model name and object names (a DNS label; "
                                                      "default: the engine folder's).")] = None,
        image: Annotated[str | None, typer.Option(help="kserve: the image the manifests run "
                                                       "(default: llmc-NAME:latest).")] = None,
        port: Annotated[int, typer.Option(help="The port `llmc serve` listens on.")] = 8000,
        threads: Annotated[int, typer.Option(help="Engine threads (0: the container's cores).")] = 0,
        kv_budget_mb: Annotated[int, typer.Option(help="Memory for the KV cache (kserve: part of the "
                                                       "memory request).")] = 1024,
        max_running: Annotated[int, typer.Option(help="Sequences decoding together.")] = 8,
        replicas: Annotated[int, typer.Option(help="kserve/ray: replicas (the minimum when autoscaling).")] = 1,
        max_replicas: Annotated[int | None, typer.Option(help="kserve/ray: autoscale up to this many.")] = None,
        mount_engine: Annotated[bool, typer.Option(help="docker: mount the engine at /engine at run time "
                                                        "instead of copying it into the image.")] = False,
    ) -> None:
        """Package an engine for a platform: docker, triton, kserve or ray."""
        from llmc.deploy.package import PackageConfig, package

        config = PackageConfig(engine_dir, target, out, force=force, name=name, image=image, port=port,
                               threads=threads, kv_budget_mb=kv_budget_mb, max_running=max_running,
                               replicas=replicas, max_replicas=max_replicas, mount_engine=mount_engine)
        files = package(config)
        tops = sorted({f.split("/")[0] + ("/" if "/" in f else "") for f in files})
        typer.echo(f"wrote {len(files)} files into {out} ({target.value}): {', '.join(tops)}")

    deploy = typer.Typer(no_args_is_help=True, help="Serve at scale on a distributed engine.")
    app.add_typer(deploy, name="deploy")

    @deploy.command("ray")
    @wrap
    def ray_command(
        engine_dir: Annotated[Path, typer.Argument(help="Engine folder (on every node of the cluster).")],
        replicas: Annotated[int, typer.Option(help="Engine replicas (the initial count when autoscaling).")] = 2,
        min_replicas: Annotated[int | None, typer.Option(help="Autoscaling: the fewest replicas.")] = None,
        max_replicas: Annotated[int | None, typer.Option(help="Autoscaling: the most replicas.")] = None,
        target_ongoing_requests: Annotated[float, typer.Option(
            help="Autoscaling: requests in flight per replica Ray Serve aims at.")] = 4.0,
        threads: Annotated[int, typer.Option(help="Engine threads per replica (CPUs Ray reserves).")] = 1,
        max_running: Annotated[int, typer.Option(help="Sequences decoding together, per replica.")] = 8,
        max_queue: Annotated[int, typer.Option(help="Sequences waiting per replica.")] = 16,
        kv_budget_mb: Annotated[int, typer.Option(help="KV cache memory per replica.")] = 512,
        chat_template: ChatTemplate = None,
        served_model_name: Annotated[str | None, typer.Option(help="Name clients pass as `model`.")] = None,
        host: Annotated[str, typer.Option(help="Address Ray Serve's HTTP proxy listens on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port Ray Serve's HTTP proxy listens on.")] = 8000,
        address: Annotated[str | None, typer.Option(
            help="A Ray cluster to join (e.g. 'auto'); default: start a local one.")] = None,
        api_key: Annotated[str | None, typer.Option(
            envvar="LLMC_API_KEY", show_envvar=True, help="Require 'Authorization: Bearer KEY' on /v1/*.")] = None,
    ) -> None:
        """An OpenAI-compatible Ray Serve app: one ingress, N engine replicas; serves until SIGTERM/Ctrl-C."""
        from llmc.deploy.package import EngineFacts
        from llmc.deploy.ray_settings import RayAppConfig
        from llmc.errors import BackendUnavailableError, InputError
        from llmc.runtime.config import SERVE_STEP_TOKENS

        EngineFacts.read(engine_dir)  # a readable manifest and every file it lists, before a cluster starts
        if not 1 <= port <= 65535:  # (0, any free port, would leave the app's address unknown)
            raise InputError(f"--port must be in [1, 65535], got {port}")
        if not host.strip():
            raise InputError("--host must not be empty (0.0.0.0: every address)")
        if max_running > SERVE_STEP_TOKENS:
            raise InputError(f"--max-running must be <= {SERVE_STEP_TOKENS} (the tokens per engine step of a replica), "
                             f"got {max_running}")
        cpus = os.cpu_count() or 1
        if address is None and not os.environ.get("RAY_ADDRESS") and threads > cpus:  # Ray would wait forever
            raise InputError(f"--threads ({threads}) must be <= this machine's {cpus} CPUs: the local Ray cluster "
                             "could never place a replica (--address joins a larger cluster)")
        if chat_template is not None and not chat_template.is_file():
            raise InputError(f"--chat-template {chat_template} is not a file")
        cfg = RayAppConfig(engine_dir=str(engine_dir.resolve()), model_name=served_model_name, replicas=replicas,
                           min_replicas=min_replicas, max_replicas=max_replicas,
                           target_ongoing_requests=target_ongoing_requests, threads=threads,
                           max_running=max_running, max_queue=max_queue, kv_budget_mb=kv_budget_mb,
                           chat_template=str(chat_template.resolve()) if chat_template else None, api_key=api_key)
        try:
            from llmc.deploy.ray_app import run_until_signal
        except ImportError as e:
            raise BackendUnavailableError(f"llmc deploy ray needs Ray Serve ({e.name} is missing): "
                                          "pip install 'llmc[ray]'") from None
        run_until_signal(cfg, host, port, address)
