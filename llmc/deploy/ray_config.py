"""`--target ray`: a Ray Serve config file (`serve run config.yaml`) for llmc's Ray Serve application."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from llmc.deploy.package import EngineFacts, PackageConfig
from llmc.deploy.ray_settings import RayAppConfig


def app_config(config: PackageConfig) -> RayAppConfig:
    return RayAppConfig(engine_dir=str(config.engine_dir.resolve()), model_name=config.served_name,
                        replicas=config.replicas, max_replicas=config.max_replicas, threads=config.threads or 1,
                        kv_budget_mb=config.kv_budget_mb, max_running=config.max_running)


def serve_config(config: PackageConfig) -> dict[str, object]:
    """The Ray Serve config schema: one application built by `llmc.deploy.ray_app:build_app` from `args`."""
    args = {k: v for k, v in asdict(app_config(config)).items() if v is not None}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": config.port},
        "applications": [{"name": "llmc", "route_prefix": "/", "import_path": "llmc.deploy.ray_app:build_app",
                          "args": args}],
    }


def write(config: PackageConfig, facts: EngineFacts, work: Path) -> list[str]:
    import yaml

    head = (f"# {facts.model_name} on Ray Serve: an OpenAI-compatible ingress and {config.replicas} engine "
            f"replica(s){f' (autoscaling to {config.max_replicas})' if config.max_replicas else ''}.\n"
            "# Written by `llmc package --target ray`. Run on a Ray cluster with llmc installed (pip install "
            "'llmc[serve,ray]'):\n#   serve run config.yaml\n"
            "# The engine folder must be at engine_dir on every node.\n")
    (work / "config.yaml").write_text(head + yaml.safe_dump(serve_config(config), sort_keys=False))
    return ["config.yaml"]
