"""llmc: compile decoder-only LLMs into prefill + decode engines and run them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from llmc.runtime.llm import LLM
    from llmc.runtime.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import llmc` stays cheap and `llmc.export` never loads the runtime (or the reverse).
    if name == "LLM":
        from llmc.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from llmc.runtime.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
