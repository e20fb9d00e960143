"""The GGUF round trips' tiny models drawn from one seed: each test's weights the same from run to run (their
largest logits, and with them the round trip's rounding, vary with the draw)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.module.__name__.rsplit(".", 1)[-1].startswith("test_gguf_archs"):
        import torch

        torch.manual_seed(0)
    yield
