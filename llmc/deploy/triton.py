"""`--target triton`: a Triton Inference Server model repository for the Python backend.

OUT/models/<name>/config.pbtxt (decoupled: one request streams many responses), OUT/models/<name>/1/model.py
(llmc's runtime, one engine with continuous batching across every Triton request), OUT/models/<name>/1/engine/;
and a Dockerfile that adds llmc's runtime to a Triton image (from llmc-src/, compiled there for the image's own
Python, with the pinned requirements.txt).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from llmc.deploy.package import EngineFacts, PackageConfig
from llmc.deploy.wheel import copy_sources, runtime_requirements

MODEL_PY = Path(__file__).with_name("triton_model.py")


TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:25.01-py3"  # any release with the Python backend


def write(config: PackageConfig, facts: EngineFacts, work: Path) -> list[str]:
    name = config.served_name
    version = work / "models" / name / "1"
    version.mkdir(parents=True)
    shutil.copy2(MODEL_PY, version / "model.py")
    shutil.copytree(config.engine_dir, version / "engine")
    (work / "models" / name / "config.pbtxt").write_text(config_pbtxt(config, facts))
    copy_sources(work / "llmc-src")
    # the Python backend's own interpreter runs model.py: llmc's runtime only (no server, no torch)
    (work / "requirements.txt").write_text("\n".join(runtime_requirements(extras=())) + "\n")
    (work / "Dockerfile").write_text(dockerfile(config))
    return [p.relative_to(work).as_posix() for p in sorted(work.rglob("*")) if p.is_file()]


def dockerfile(config: PackageConfig) -> str:
    return f"""\
# Triton Inference Server with llmc's runtime for the Python backend; written by `llmc package --target triton`.
# Build: docker build -t {config.served_name}-triton .   Run: docker run -p 8000:8000 -p 8001:8001 {config.served_name}-triton
ARG TRITON_IMAGE={TRITON_IMAGE}
FROM ${{TRITON_IMAGE}}
# llmc's operators compile here, for this image's Python (the Python backend runs it)
RUN apt-get update && apt-get install -y --no-install-recommends gcc && rm -rf /var/lib/apt/lists/*
COPY requirements.txt /tmp/requirements.txt
COPY llmc-src/ /tmp/llmc-src/
RUN pip install --no-cache-dir -r /tmp/requirements.txt /tmp/llmc-src && rm -rf /tmp/requirements.txt /tmp/llmc-src
COPY models/ /models/
CMD ["tritonserver", "--model-repository=/models"]
"""


def config_pbtxt(config: PackageConfig, facts: EngineFacts) -> str:
    return f"""\
# {facts.model_name} ({facts.backend}, {facts.precision}) on llmc's runtime; written by `llmc package --target triton`
name: "{config.served_name}"
backend: "python"
max_batch_size: 0  # llmc batches across requests itself (continuous batching): Triton hands requests as they come
model_transaction_policy {{ decoupled: true }}  # a request streams its text as responses, the last one flagged final

input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "temperature" data_type: TYPE_FP32 dims: [ 1 ] optional: true }},
  {{ name: "top_p" data_type: TYPE_FP32 dims: [ 1 ] optional: true }},
  {{ name: "top_k" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "seed" data_type: TYPE_INT64 dims: [ 1 ] optional: true }},
  {{ name: "chat" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}
]
output [
  {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "finish_reason" data_type: TYPE_STRING dims: [ 1 ] }}
]

instance_group [ {{ count: 1 kind: KIND_CPU }} ]  # one engine per model instance; it serves every request

parameters [
  {{ key: "engine_dir" value: {{ string_value: "engine" }} }},
  {{ key: "threads" value: {{ string_value: "{config.threads}" }} }},
  {{ key: "kv_budget_mb" value: {{ string_value: "{config.kv_budget_mb}" }} }},
  {{ key: "max_running" value: {{ string_value: "{config.max_running}" }} }},
  {{ key: "max_queue" value: {{ string_value: "64" }} }}
]
"""
