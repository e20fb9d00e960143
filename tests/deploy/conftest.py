"""Fixtures for the deployment tests: a tiny random Llama engine (with tokenizer and chat template), built once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def deploy_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_model

    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.export.exporter import ExportConfig, export

    root = tmp_path_factory.mktemp("deploy-tiny")
    hf = make_model("llama", root / "hf")
    export(ExportConfig(str(hf), root / "export"))
    build_ort(BuildConfig(root / "export", root / "engine", force=True))
    return root / "engine"
