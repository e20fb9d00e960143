"""Precision chosen by measurement: the calibration graph, each layer's sensitivity, and the build that raises the
most sensitive layers until llmc verify's top-1 agreement reaches the target."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import Built

from llmc.engines.kernels import library_path
from llmc.engines.ort_build import BuildConfig, build_ort, export_engine
from llmc.engines.ort_graphs import load_checkpoint, quantizable
from llmc.engines.quality import CALIBRATION_PROMPTS, PrecisionSearch
from llmc.engines.registry import load_engine_dir
from llmc.graph.quant import QuantSpec
from llmc.manifest import load_export
from llmc.runtime.tokenizer import Tokenizer
from llmc.runtime.verify import VERIFY_PROMPTS, compare_engines, encode_prompt


@pytest.fixture(scope="module")
def search(tiny_llama: Built) -> PrecisionSearch:
    export = load_export(tiny_llama.export_dir)
    ckpt = load_checkpoint(tiny_llama.export_dir, export)
    names = [n.removesuffix(".weight") for n in quantizable(ckpt)] + ["lm_head"]
    tok = Tokenizer.from_dir(tiny_llama.export_dir)
    reference = export_engine(export, tiny_llama.export_dir)
    return PrecisionSearch(ckpt, names, QuantSpec(4, kernel="llmc"), reference,
                           [encode_prompt(tok, p) for p in CALIBRATION_PROMPTS], library_path(), 1)


def test_the_calibration_graph_is_the_model_when_every_layer_is_exact(search: PrecisionSearch,
                                                                      tiny_llama: Built) -> None:
    """With every layer's share at 0 it computes the fp32 export: its log-probabilities at the scored positions
    are those of the export's own engine along the same tokens."""
    reference = export_engine(load_export(tiny_llama.export_dir), tiny_llama.export_dir)
    rows = search._feeds["calibrate.positions"]
    ids = search._feeds["input_ids"]
    for b in sorted(set(rows[:, 0].tolist()))[:2]:
        cols = rows[rows[:, 0] == b, 1]
        seq = ids[b, :cols[-1] + 1].tolist()
        kv = reference.new_kv_cache(1, len(seq) + 1)
        logits = [reference.prefill([0], [seq[:cols[0] + 1]], kv)[0]]
        logits += [reference.decode([0], [[t]], kv)[0] for t in seq[cols[0] + 1:]]
        x = np.stack(logits).astype(np.float64)
        x -= x.max(-1, keepdims=True)
        x -= np.log(np.exp(x).sum(-1, keepdims=True))
        ours = search._reference[rows[:, 0] == b]
        assert np.abs(ours - x).max() < 1e-3


def test_each_layer_has_a_sensitivity_and_raising_all_of_them_is_the_model(search: PrecisionSearch) -> None:
    assert len(search.sensitivities) == 2 * 4 + 1 and all(s.kl >= 0 for s in search.sensitivities)
    assert sorted(s.kl for s in search.sensitivities)[-1] > 0  # 4 bits change something
    kls = [search.sensitivities[i].kl for i in search.order]
    assert kls == sorted(kls, reverse=True)
    assert search.predicted_top1(len(search.names)) == 1.0
    assert search.predicted_top1(0) < 1.0  # random tiny weights: 4 bits flip some tokens
    # the tiny model's random weights are not on a 4-bit grid: raised layers take 8-bit weights
    assert {p for _, p in search.layout(len(search.names))} == {"int8-fp32act"}
    k = search.first_k(0.99)
    assert 0 < k <= len(search.names) and search.predicted_top1(k) >= 0.99
    assert [n for n, _ in search.layout(k)] == [search.names[i] for i in search.order[:k]]


def test_a_quality_target_build_reaches_it_and_records_the_layout(tiny_llama: Built, tmp_path: Path) -> None:
    manifest = build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "q", quant="int4"))
    quality = manifest.settings.quality
    assert quality["target"] == 0.99 and quality["candidates"] == 9
    assert quality["top1_agreement"] >= 0.99 or len(quality["raised"]) == quality["candidates"]
    reference = export_engine(load_export(tiny_llama.export_dir), tiny_llama.export_dir)
    tok = Tokenizer.from_dir(tmp_path / "q")
    report = compare_engines(reference, load_engine_dir(tmp_path / "q"), [encode_prompt(tok, p) for p in VERIFY_PROMPTS])
    assert report["top1_agreement"] == pytest.approx(quality["top1_agreement"])  # what llmc verify measures
    plain = build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "p", quant="int4", quality_target=0,
                                  allow_divergence=True))
    assert not plain.settings.quality
