"""Fixtures for the deployment tests: a tiny random Llama engine (with tokenizer and chat template), built once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def deploy_engine_dir(serve_engine_dir: Path) -> Path:
    """The server tests' tiny engine (tests/conftest.py), built once for both."""
    return serve_engine_dir
