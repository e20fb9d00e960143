"""`--target docker`: a build context for a slim image that serves the engine with `llmc serve`.

OUT/Dockerfile, .dockerignore, requirements.txt (pinned, no torch), wheels/llmc-*.whl, engine/ (unless mounted).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from llmc.deploy.package import EngineFacts, PackageConfig
from llmc.deploy.wheel import build_wheel, python_tag, runtime_requirements

ENGINE_IN_IMAGE = "/engine"
UID = 10001


def write(config: PackageConfig, facts: EngineFacts, work: Path) -> list[str]:
    wheel = build_wheel(work / "wheels")
    (work / "requirements.txt").write_text("\n".join(runtime_requirements()) + "\n")
    files = ["Dockerfile", ".dockerignore", "requirements.txt", f"wheels/{wheel.name}"]
    if not config.mount_engine:
        shutil.copytree(config.engine_dir, work / "engine")
        files += [f"engine/{p.relative_to(work / 'engine')}" for p in sorted((work / "engine").rglob("*"))
                  if p.is_file()]
    (work / "Dockerfile").write_text(dockerfile(config, facts, wheel.name))
    (work / ".dockerignore").write_text(DOCKERIGNORE)
    return files


DOCKERIGNORE = """\
# only what the Dockerfile copies goes to the daemon
**
!requirements.txt
!wheels/
!engine/
"""


def serve_args(config: PackageConfig, engine: str = ENGINE_IN_IMAGE) -> list[str]:
    """`llmc serve`'s command line in a container: every address, the package's engine settings."""
    return ["llmc", "serve", engine, "--host", "0.0.0.0", "--port", str(config.port),
            "--served-model-name", config.served_name, "--threads", str(config.threads),
            "--kv-budget-mb", str(config.kv_budget_mb), "--max-running", str(config.max_running)]


def dockerfile(config: PackageConfig, facts: EngineFacts, wheel: str) -> str:
    entry = ", ".join(f'"{a}"' for a in serve_args(config))
    engine = ("# the engine is mounted here at run time: docker run -v /path/to/engine:/engine:ro ...\n"
              f"VOLUME {ENGINE_IN_IMAGE}" if config.mount_engine
              else f"COPY --chown={UID}:{UID} engine/ {ENGINE_IN_IMAGE}/")
    return f"""\
# llmc: {facts.model_name} ({facts.backend}, {facts.precision}) served by `llmc serve`, OpenAI-compatible.
# Written by `llmc package --target docker`. Build: docker build -t {config.image_ref} .
# Run: docker run -p {config.port}:{config.port} {config.image_ref}
# The wheel carries llmc's compiled operators (built for CPython {python_tag()}, linux x86_64): no compiler here.
FROM python:{python_tag()}-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \\
    HOME=/home/llmc LLMC_CACHE=/home/llmc/.cache/llmc

# the runtime's dependencies only (pinned: the set llmc was packaged and tested with); no torch, no transformers
COPY requirements.txt /tmp/requirements.txt
COPY wheels/ /tmp/wheels/
RUN pip install -r /tmp/requirements.txt /tmp/wheels/{wheel} \\
    && rm -rf /tmp/requirements.txt /tmp/wheels \\
    && useradd --uid {UID} --create-home --home-dir /home/llmc --shell /usr/sbin/nologin llmc

{engine}
USER {UID}:{UID}
WORKDIR /home/llmc
EXPOSE {config.port}

HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \\
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:{config.port}/health', timeout=4).status != 200)"]

# SIGTERM drains in-flight requests (--shutdown-timeout) and exits 0
STOPSIGNAL SIGTERM
ENTRYPOINT [{entry}]
"""
