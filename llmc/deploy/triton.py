"""`--target triton`: a Triton Inference Server model repository for the Python backend.

OUT/<name>/config.pbtxt (decoupled: one request streams many responses), OUT/<name>/1/model.py (llmc's runtime,
one engine with continuous batching across every Triton request), OUT/<name>/1/engine/, and the wheel +
requirements the Triton image needs to install (`pip install -r requirements.txt wheels/llmc-*.whl`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from llmc.deploy.package import EngineFacts, PackageConfig
from llmc.deploy.wheel import build_wheel, runtime_requirements

MODEL_PY = Path(__file__).with_name("triton_model.py")


def write(config: PackageConfig, facts: EngineFacts, work: Path) -> list[str]:
    name = config.served_name
    version = work / name / "1"
    version.mkdir(parents=True)
    shutil.copy2(MODEL_PY, version / "model.py")
    shutil.copytree(config.engine_dir, version / "engine")
    (work / name / "config.pbtxt").write_text(config_pbtxt(config, facts))
    wheel = build_wheel(work / "wheels")
    # the Python backend's own interpreter runs model.py: llmc's runtime only (no server, no torch)
    (work / "requirements.txt").write_text("\n".join(runtime_requirements(extras=())) + "\n")
    engine_files = [f"{name}/1/engine/{p.relative_to(version / 'engine')}"
                    for p in sorted((version / "engine").rglob("*")) if p.is_file()]
    return [f"{name}/config.pbtxt", f"{name}/1/model.py", "requirements.txt", f"wheels/{wheel.name}", *engine_files]


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
