"""The manifests: round trips, format versions, checksums of the files they list, and safe external-data paths."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
from conftest import Built

from llmc.engines.ort.build import BuildConfig, build_ort
from llmc.engines.registry import load_engine_dir
from llmc.errors import ManifestError
from llmc.manifest import (
    ENGINE_FORMAT_VERSION,
    ENGINE_MANIFEST,
    EXPORT_FORMAT_VERSION,
    EXPORT_MANIFEST,
    load_engine,
    load_export,
    save,
    sha256_file,
)
from llmc.onnx_store import check_external_paths


@pytest.fixture(scope="module")
def built(tiny_factory: Callable[[str], Built]) -> Built:
    return tiny_factory("llama")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# -- round trips and versions ---------------------------------------------------------------------------------

def test_export_manifest_round_trip(tmp_path: Path, built: Built) -> None:
    manifest = load_export(built.export_dir)
    assert isinstance(manifest.prefill.inputs, tuple) and isinstance(manifest.prefill.inputs[0].shape, tuple)
    save(manifest, tmp_path)
    assert (tmp_path / EXPORT_MANIFEST).is_file()
    again = load_export(tmp_path)
    assert again == manifest
    assert again.format_version == EXPORT_FORMAT_VERSION and again.format == "llmc-export"
    assert set(manifest.files) >= {"prefill.onnx", "decode.onnx", "weights.bin", "golden.npz", "tokenizer.json"}
    for name, digest in manifest.files.items():
        assert sha256_file(built.export_dir / name) == digest


def test_engine_manifest_round_trip(tmp_path: Path, built: Built) -> None:
    manifest = load_engine(built.engine_dir)
    save(manifest, tmp_path)
    assert (tmp_path / ENGINE_MANIFEST).is_file()
    assert load_engine(tmp_path) == manifest
    assert manifest.export_manifest_sha256 == sha256_file(built.export_dir / EXPORT_MANIFEST)


@pytest.mark.parametrize(("manifest", "version", "load"), [
    (EXPORT_MANIFEST, EXPORT_FORMAT_VERSION, load_export),
    (ENGINE_MANIFEST, ENGINE_FORMAT_VERSION, load_engine),
])
def test_wrong_format_version(tmp_path: Path, built: Built, manifest: str, version: int,
                              load: Callable[[Path], object]) -> None:
    src = built.export_dir if manifest == EXPORT_MANIFEST else built.engine_dir
    shutil.copy(src / manifest, tmp_path / manifest)
    _edit_json(tmp_path / manifest, format_version=version + 98)
    with pytest.raises(ManifestError) as e:
        load(tmp_path)
    assert f"format_version {version + 98}" in str(e.value)
    assert f"version {version}" in str(e.value)


def test_wrong_format_name(tmp_path: Path, built: Built) -> None:
    shutil.copy(built.engine_dir / ENGINE_MANIFEST, tmp_path / EXPORT_MANIFEST)
    with pytest.raises(ManifestError, match="'llmc-engine', expected 'llmc-export'"):
        load_export(tmp_path)


def test_missing_invalid_and_incomplete_manifests(tmp_path: Path, built: Built) -> None:
    with pytest.raises(ManifestError, match="no manifest"):
        load_export(tmp_path)
    (tmp_path / EXPORT_MANIFEST).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_export(tmp_path)
    data = json.loads((built.export_dir / EXPORT_MANIFEST).read_text())
    del data["model"]
    (tmp_path / EXPORT_MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="llmc.json: model is missing"):
        load_export(tmp_path)


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: [d], "must hold a JSON object, got list"),
    (lambda d: {**d, "model": "oops"}, 'model must be an object, got "oops"'),
    (lambda d: {**d, "model": {**d["model"], "hidden_size": "64"}}, 'model.hidden_size must be an integer, got "64"'),
    (lambda d: {**d, "model": {**d["model"], "num_layers": True}}, "model.num_layers must be an integer, got true"),
    (lambda d: {**d, "kv": {k: v for k, v in d["kv"].items() if k != "head_dim"}}, "kv.head_dim is missing"),
    (lambda d: {**d, "prefill": {**d["prefill"], "inputs": {"a": 1}}}, "prefill.inputs must be a list"),
    (lambda d: {**d, "prefill": {**d["prefill"], "inputs": [{"name": "x", "dtype": "int64", "shape": [1.5]}]}},
     "prefill.inputs[0].shape[0] must be an integer or a string, got 1.5"),
    (lambda d: {**d, "files": ["a"]}, "files must be an object"),
    (lambda d: {**d, "generation": {**d["generation"], "eos_token_ids": 2}}, "generation.eos_token_ids must be a list"),
    (lambda d: {**d, "settings": None}, "settings must be an object, got null"),
])
@pytest.mark.parametrize("which", ["export", "engine"])
def test_a_manifest_of_the_wrong_shape_names_the_field(tmp_path: Path, built: Built, which: str, change: Any,
                                                        words: str) -> None:
    src, name, load = ((built.export_dir, EXPORT_MANIFEST, load_export) if which == "export"
                       else (built.engine_dir, ENGINE_MANIFEST, load_engine))
    data = json.loads((src / name).read_text())
    if which == "export" and "settings" in words:
        return  # an export manifest has no settings
    (tmp_path / name).write_text(json.dumps(change(data)))
    with pytest.raises(ManifestError) as e:
        load(tmp_path)
    assert words in str(e.value) and name in str(e.value) and "\n" not in str(e.value)


def test_unknown_keys_are_ignored(tmp_path: Path, built: Built) -> None:
    """A later minor addition to the manifest does not break this reader."""
    shutil.copy(built.export_dir / EXPORT_MANIFEST, tmp_path / EXPORT_MANIFEST)
    _edit_json(tmp_path / EXPORT_MANIFEST, some_future_field={"x": 1})
    assert load_export(tmp_path) == load_export(built.export_dir)


# -- the files a manifest lists -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["weights.bin", "model.onnx", "tokenizer.json"])
def test_modified_engine_file_is_refused(tmp_path: Path, built: Built, name: str) -> None:
    engine = _copy(built.engine_dir, tmp_path / "engine")
    load_engine_dir(engine)  # the unmodified copy loads
    _flip_byte(engine / name, (engine / name).stat().st_size // 2)
    with pytest.raises(ManifestError) as e:
        load_engine_dir(engine)
    assert name in str(e.value) and "modified" in str(e.value)


def test_missing_engine_file_is_refused(tmp_path: Path, built: Built) -> None:
    engine = _copy(built.engine_dir, tmp_path / "engine")
    (engine / "weights.bin").unlink()
    with pytest.raises(ManifestError, match="weights.bin.*missing"):
        load_engine_dir(engine)


def test_build_refuses_a_modified_export(tmp_path: Path, built: Built) -> None:
    export = _copy(built.export_dir, tmp_path / "export")
    _flip_byte(export / "weights.bin", 5)
    with pytest.raises(ManifestError, match="weights.bin"):
        build_ort(BuildConfig(export, tmp_path / "engine"))
    assert not (tmp_path / "engine").exists()
    assert not list(tmp_path.glob(".engine.partial-*"))


def test_graph_names_that_differ_from_the_manifest_are_reported(tmp_path: Path, built: Built) -> None:
    engine = _copy(built.engine_dir, tmp_path / "engine")
    manifest = json.loads((engine / ENGINE_MANIFEST).read_text())
    manifest["prefill"]["inputs"][0]["name"] = "tokens"
    (engine / ENGINE_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError) as e:
        load_engine_dir(engine)
    assert manifest["prefill"]["file"] in str(e.value)
    assert "missing ['tokens']" in str(e.value) and "unexpected ['input_ids']" in str(e.value)


# -- external data paths --------------------------------------------------------------------------------------

def _point_first_initializer_at(src: Path, dst: Path, location: str) -> None:
    model = onnx.load(str(src), load_external_data=False)
    init = next(i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL)
    for entry in init.external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(model, str(dst))


def test_graphs_of_an_export_pass_the_path_check(built: Built) -> None:
    for folder in (built.export_dir, built.engine_dir):
        for graph in folder.glob("*.onnx"):
            check_external_paths(graph)


@pytest.mark.parametrize("location", ["../evil.bin", "sub/../../evil.bin", "/tmp/evil.bin"])
def test_external_data_outside_the_folder_is_refused(tmp_path: Path, built: Built, location: str) -> None:
    folder = tmp_path / "graphs"
    folder.mkdir()
    shutil.copy(built.export_dir / "weights.bin", tmp_path / "evil.bin")
    _point_first_initializer_at(built.export_dir / "prefill.onnx", folder / "prefill.onnx", location)
    with pytest.raises(ManifestError) as e:
        check_external_paths(folder / "prefill.onnx")
    assert location in str(e.value) and "prefill.onnx" in str(e.value)


def test_engine_with_escaping_external_data_is_refused(tmp_path: Path, built: Built) -> None:
    """Even with matching checksums, the engine loader runs the path check before ONNX Runtime reads anything."""
    engine = _copy(built.engine_dir, tmp_path / "engine")
    shutil.copy(engine / "weights.bin", tmp_path / "evil.bin")
    manifest = json.loads((engine / ENGINE_MANIFEST).read_text())
    graph = manifest["decode"]["file"]
    _point_first_initializer_at(engine / graph, engine / graph, "../evil.bin")
    manifest["files"][graph] = sha256_file(engine / graph)
    (engine / ENGINE_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="escapes"):
        load_engine_dir(engine)
