"""What a build holds in memory: the float checkpoint as a view of the export's file, a reference engine without
packed copies of its weights, the reference traced once, and wide weights quantized a slice at a time
(docs/performance_notes.md, s59: a 0.5 B-parameter model's int4 build 16.1 -> 6.2 GB peak RSS)."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import Built

from llmc.engines.ort.build import ExportEngine, export_engine
from llmc.engines.ort.graphs import load_checkpoint
from llmc.engines.ort.run import OrtEngine
from llmc.engines.registry import load_engine_dir
from llmc.errors import ManifestError
from llmc.graph import quant
from llmc.graph.quant import compact_table, pack_q4_tiles, pack_q8_tiles
from llmc.manifest import load_export
from llmc.onnx_store import MappedFiles, load_graph, to_numpy
from llmc.runtime.verify import compare_engines, compare_to, reference_traces

RNG = np.random.default_rng(7)


def test_the_checkpoint_is_a_read_only_view_of_the_export(tiny_llama: Built) -> None:
    """Every float weight a build reads is the export's file as mapped (no copy of the model in the process's own
    memory), the values to_numpy reads, and writing to one is an error, not a change to the export."""
    export = load_export(tiny_llama.export_dir)
    ckpt = load_checkpoint(tiny_llama.export_dir, export)
    inits = {i.name: i for i in load_graph(tiny_llama.export_dir / export.decode.file).graph.initializer}
    for name, array in ckpt.weights.items():
        assert not array.flags.writeable
        assert _mapped(array), name
        if name in inits:
            assert np.array_equal(array, to_numpy(inits[name], tiny_llama.export_dir))
    with pytest.raises(ValueError, match="read-only"):
        ckpt.weights["embed.weight"][0, 0] = 1.0


def _mapped(array: np.ndarray) -> bool:
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)


def test_a_mapped_tensor_past_the_file_end_is_a_one_line_error(tiny_llama: Built, tmp_path: Path) -> None:
    export = load_export(tiny_llama.export_dir)
    init = next(i for i in load_graph(tiny_llama.export_dir / export.decode.file).graph.initializer
                if i.name == "embed.weight")
    location = next(e.value for e in init.external_data if e.key == "location")
    (tmp_path / location).write_bytes((tiny_llama.export_dir / location).read_bytes()[:4096])
    with pytest.raises(ManifestError, match=r"tensor 'embed.weight' needs bytes .* the file is damaged"):
        MappedFiles(tmp_path).array(init)


def test_a_small_export_engine_prepacks_as_a_served_engine_does(tiny_llama: Built) -> None:
    engine = export_engine(load_export(tiny_llama.export_dir), tiny_llama.export_dir)
    assert isinstance(engine, ExportEngine) and engine.prepack and engine._mapped is None


def test_the_export_engine_of_a_large_model_holds_no_packed_copy(tiny_llama: Built,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PREPACK_MAX_BYTES of weights the reference engine's sessions run ONNX Runtime's float products on the
    mapped weights (no prepacked copy a session); its logits are the prepacked engine's over the same graphs to
    float rounding."""
    monkeypatch.setattr(ExportEngine, "PREPACK_MAX_BYTES", 0)  # (the tiny model as a large one)
    export = load_export(tiny_llama.export_dir)
    lean = export_engine(export, tiny_llama.export_dir)
    packed = load_engine_dir(tiny_llama.engine("concat"))
    assert isinstance(lean, ExportEngine) and isinstance(packed, OrtEngine)
    for engine, prepacks in ((lean, False), (packed, True)):
        for session in (engine._prefill, engine._decode):
            options = session.get_session_options()  # type: ignore[attr-defined]
            if prepacks:  # (ONNX Runtime's default: no entry)
                with pytest.raises(RuntimeError, match="does not have configuration"):
                    options.get_session_config_entry("session.disable_prepacking")
            else:
                assert options.get_session_config_entry("session.disable_prepacking") == "1"
    # both sessions run on one mapping of the export's file, each tensor given to ONNX Runtime where it lies
    held = lean._mapped._held  # type: ignore[union-attr]
    files = MappedFiles(tiny_llama.export_dir)
    inits = {i.name: i for spec in (export.prefill, export.decode)
             for i in load_graph(tiny_llama.export_dir / spec.file).graph.initializer if i.external_data}
    assert len(held) == len({tuple(e.value for e in i.external_data) for i in inits.values()})
    embed = inits["embed.weight"]
    key = next(k for k in held if k[1] == int({e.key: e.value for e in embed.external_data}["offset"]))
    assert np.array_equal(held[key].numpy().view(np.float32), files.array(embed))
    assert held[key].data_ptr() == lean._mapped._files.array(embed).ctypes.data  # type: ignore[union-attr]  # (no copy)
    assert packed._mapped is None  # type: ignore[attr-defined]
    prompt = [5, 9, 14, 3, 8]
    runs = []
    for engine in (lean, packed):
        kv = engine.new_kv_cache(1, 16)
        runs.append(np.stack([engine.prefill([0], [prompt], kv)[0], engine.decode([0], [[11]], kv)[0]]))
    assert np.abs(runs[0] - runs[1]).max() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "mistral", "jamba", "gemma4_e"])
def test_the_reference_traces_its_prompts_as_one_batch_and_each_as_if_alone(tiny_factory: Callable[[str], Built],
                                                                            arch: str) -> None:
    """The build's (and llmc verify's) greedy traces of the fp32 export run the prompts as one batch, right-padded
    to the longest (Mistral's window shorter than the longest, Jamba's Mamba states, Gemma 4 E2B's shared caches
    too): each row's tokens and logits are those of its prompt run alone."""
    built = tiny_factory(arch)
    reference = export_engine(load_export(built.export_dir), built.export_dir)
    prompts = [[5, 9, 14], [7, 7, 2, 30, 4, 8, 8, 9, 10] + [3] * 12, [11]]  # (21 tokens: past the 16-token window)
    for prompt, (logits, tokens) in zip(prompts, reference_traces(reference, prompts, steps=6), strict=True):
        kv = reference.new_kv_cache(1, len(prompt) + 7)
        alone = [reference.prefill([0], [prompt], kv)[0]]
        for _ in range(6):
            alone.append(reference.decode([0], [[int(np.argmax(alone[-1]))]], kv)[0])
        assert tokens == [int(np.argmax(x)) for x in alone[:-1]]
        assert np.abs(np.stack(alone) - logits).max() < 1e-4


def test_compare_to_scores_the_traces_as_compare_engines_does(tiny_llama: Built) -> None:
    """The build traces the reference once and scores every candidate against those traces: the same report."""
    reference = export_engine(load_export(tiny_llama.export_dir), tiny_llama.export_dir)
    candidate = load_engine_dir(tiny_llama.engine_dir)
    prompts = [[5, 9, 14], [7, 7, 2, 30, 4]]
    refs = reference_traces(reference, prompts, steps=5)
    assert [len(tokens) for _, tokens in refs] == [5, 5]
    assert compare_to(refs, candidate, prompts, together=True) == compare_engines(reference, candidate, prompts, 5,
                                                                                  together=True)


def _with_ternary_blocks(w: np.ndarray) -> np.ndarray:
    w[:32, :40] = np.where(RNG.random((32, 40)) < 0.3, 0.0, np.sign(RNG.standard_normal((32, 40))) * 0.5)
    return w


@pytest.mark.parametrize("pack", [pack_q4_tiles, pack_q8_tiles])
def test_wide_weights_are_packed_a_slice_of_columns_at_a_time(pack: object,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide weight's tiles packed COLUMN_CHUNK columns at a time (the last slice padded), from a transposed view
    as a tied head comes, are the tiles of the whole weight packed at once."""
    assert callable(pack)
    w = _with_ternary_blocks(RNG.standard_normal((64, 200)).astype(np.float32))
    whole = pack(w)
    monkeypatch.setattr(quant, "COLUMN_CHUNK", 64)
    sliced = pack(np.ascontiguousarray(w.T).T)
    assert sliced.shape == whole.shape and np.array_equal(sliced, whole)


@pytest.mark.parametrize("kind", ["q8", "bf16", "neither", "last row off"])
def test_compact_tables_are_checked_a_slice_of_rows_at_a_time(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedding's compact form found slice by slice is the one found at once; a value off the grid in the last
    slice keeps the table in fp32."""
    v, h = 300, 64
    q = RNG.integers(-127, 128, (v, h // 32, 32)).astype(np.float32)
    q[..., 0] = 127
    d = (RNG.random((v, h // 32)) * 0.01 + 1e-3).astype(np.float16).astype(np.float32)
    table = {"q8": (q * d[..., None]).reshape(v, h), "neither": RNG.standard_normal((v, h)),
             "bf16": RNG.standard_normal((v, h)).astype(np.float32).view(np.uint32) & 0xFFFF0000}[
        "q8" if kind == "last row off" else kind]
    table = table.view(np.float32) if kind == "bf16" else table.astype(np.float32)
    if kind == "last row off":
        table[-1, 5] += 1e-3
    whole = compact_table(table, "e")
    monkeypatch.setattr(quant, "COLUMN_CHUNK", 64)  # (64 rows a slice: the last, of 300, 44)
    sliced = compact_table(table, "e")
    assert sorted(sliced) == sorted(whole) == {"q8": ["e" + quant.EMBED_Q8, "e" + quant.EMBED_Q8_SCALES],
                                                "bf16": ["e" + quant.EMBED_BF16]}.get(kind, [])
    for name in whole:
        assert np.array_equal(sliced[name].view(np.uint8), whole[name].view(np.uint8))
