"""llmc's operators' weights held by llmc in huge-page memory (llmc/engines/ort/weights.py): ONNX Runtime reads them
in place, the results are the same bits as with ONNX Runtime's own copy, a damaged weights file is one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import Built

from llmc.engines.ort.build import BuildConfig, build_ort
from llmc.engines.ort.weights import STREAMED_OPS, StreamedWeights
from llmc.engines.registry import load_engine_dir
from llmc.errors import ManifestError

PROMPT = [1, 5, 9, 13, 2, 7]


@pytest.fixture(scope="module")
def engines(tiny_llama: Built, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    out = {"int4": root / "int4", "bf16": root / "bf16"}
    build_ort(BuildConfig(tiny_llama.export_dir, out["int4"], quant="int4", quality_target=0.0,
                          allow_divergence=True))
    build_ort(BuildConfig(tiny_llama.export_dir, out["bf16"], dtype="bfloat16", allow_divergence=True))
    return out


def _streamed_bytes(engine: Path) -> int:
    model = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    names = {x for n in model.graph.node if n.domain == "ai.llmc" and n.op_type in STREAMED_OPS for x in n.input[1:]}
    return sum(int(e.value) for name in names & inits.keys() for e in inits[name].external_data if e.key == "length")


def _logits(engine: object) -> np.ndarray:
    kv = engine.new_kv_cache(1, 32)  # type: ignore[attr-defined]
    first = engine.prefill([0], [PROMPT], kv)  # type: ignore[attr-defined]
    return np.concatenate([first, engine.decode([0], [[3]], kv)])  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["int4", "bf16"])
def test_the_sessions_read_llmcs_copy_and_compute_the_same_bits(kind: str, engines: dict[str, Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    held = load_engine_dir(engines[kind])
    assert held._weights is not None and held._weights.nbytes == _streamed_bytes(engines[kind]) > 0
    monkeypatch.setenv("LLMC_HUGE_PAGES", "0")
    plain = load_engine_dir(engines[kind])
    assert plain._weights is None
    expected = _logits(plain)
    np.testing.assert_array_equal(_logits(held), expected)
    for part in held._weights._memory:  # zeroed, the engine's answers change: the sessions read this memory
        if isinstance(part, np.ndarray) and part.ndim == 1:
            part[:] = 0
    assert not np.array_equal(_logits(held), expected)


def test_the_memory_asks_for_huge_pages(engines: dict[str, Path]) -> None:
    """Where the kernel has transparent huge pages (whatever its policy, even "never": the advice is kept) the
    mapping is advised MADV_HUGEPAGE; a kernel built without them refuses the advice, and the weights stay in plain
    pages."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file()
    engine = load_engine_dir(engines["int4"])
    arena = next(p for p in engine._weights._memory if isinstance(p, np.ndarray) and p.ndim == 1)
    address = arena.ctypes.data
    flags, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
            break
    assert flags is not None and ("hg" in flags) == thp  # the advice (a tiny engine's mapping is smaller than one
    # huge page, so only the advice can be checked here; SmolLM2's: ~92 MB in 2 MB pages)


class _Options:
    def __init__(self) -> None:
        self.added: list[str] = []

    def add_initializer(self, name: str, value: object) -> None:
        self.added.append(name)


def test_shared_tensors_are_read_once_and_a_short_file_is_one_line(engines: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    weights, options = StreamedWeights(), _Options()
    count = weights.add_to(options, engines["int4"] / "model.onnx")
    assert count == len(options.added) > 0
    held = weights.nbytes
    assert weights.add_to(_Options(), engines["int4"] / "model.onnx") == count and weights.nbytes == held

    damaged = tmp_path / "engine"
    shutil.copytree(engines["int4"], damaged)
    data = damaged / "weights.bin"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ManifestError, match=r"past the file's end .* the file is damaged") as info:
        StreamedWeights().add_to(_Options(), damaged / "model.onnx")
    assert "\n" not in str(info.value)
