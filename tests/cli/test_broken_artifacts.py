"""Artifacts broken in ways a checksum does not catch, and values a sampler cannot carry, given to the CLI: each
is one `error:` line and exit 1, never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest
from conftest import Built
from typer.testing import CliRunner

from llmc.cli.main import app
from llmc.manifest import ENGINE_MANIFEST, EXPORT_MANIFEST, sha256_file

from .test_cli import _assert_user_error, _cli


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rechecksum(folder: Path, manifest: str, file: str) -> None:
    """Record the file's new checksum, as someone covering their tracks (or a sloppy tool) would."""
    data = json.loads((folder / manifest).read_text())
    data["files"][file] = sha256_file(folder / file)
    (folder / manifest).write_text(json.dumps(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_truncated_engine_graph_with_a_matching_checksum(tmp_path: Path, tiny_llama: Built) -> None:
    engine = _copy(tiny_llama.engine_dir, tmp_path / "engine")
    graph = json.loads((engine / ENGINE_MANIFEST).read_text())["decode"]["file"]
    _truncate(engine / graph)
    _rechecksum(engine, ENGINE_MANIFEST, graph)
    _assert_user_error(_cli("run", engine, "hi", "--max-tokens", "2"), graph, "not a readable ONNX graph")
    _assert_user_error(_cli("verify", engine), graph, "not a readable ONNX graph")


def test_a_truncated_export_graph_with_a_matching_checksum(tmp_path: Path, tiny_llama: Built) -> None:
    export = _copy(tiny_llama.export_dir, tmp_path / "export")
    _truncate(export / "decode.onnx")
    _rechecksum(export, EXPORT_MANIFEST, "decode.onnx")
    for extra in ((), ("--kv-layout", "concat")):
        _assert_user_error(_cli("build", export, "-o", tmp_path / "engine", *extra), "decode.onnx",
                           "not a readable ONNX graph")
        assert not (tmp_path / "engine").exists()


def test_truncated_weights_with_a_matching_checksum(tmp_path: Path, tiny_llama: Built) -> None:
    export = _copy(tiny_llama.export_dir, tmp_path / "export")
    weights = json.loads((export / EXPORT_MANIFEST).read_text())["weights_file"]
    _truncate(export / weights)
    _rechecksum(export, EXPORT_MANIFEST, weights)
    _assert_user_error(_cli("build", export, "-o", tmp_path / "engine"), weights, "damaged")


def test_external_data_that_escapes_the_export_is_refused_by_build(tmp_path: Path, tiny_llama: Built) -> None:
    export = _copy(tiny_llama.export_dir, tmp_path / "export")
    (tmp_path / "secret.bin").write_bytes(b"\0" * 4096)
    model = onnx.load(str(export / "prefill.onnx"), load_external_data=False)
    first = next(i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL)
    for entry in first.external_data:
        if entry.key == "location":
            entry.value = "../secret.bin"
    onnx.save(model, str(export / "prefill.onnx"))
    _rechecksum(export, EXPORT_MANIFEST, "prefill.onnx")
    for extra in ((), ("--kv-layout", "concat")):
        _assert_user_error(_cli("build", export, "-o", tmp_path / "engine", *extra), "../secret.bin", "escapes")


@pytest.mark.parametrize(("manifest", "change", "words"), [
    ("engine", lambda d: [d], "must hold a JSON object, got list"),
    ("engine", lambda d: {**d, "model": "oops"}, 'model must be an object, got "oops"'),
    ("engine", lambda d: {**d, "kv": {**d["kv"], "num_layers": "2"}}, "kv.num_layers must be an integer"),
    ("export", lambda d: {**d, "model": "oops"}, 'model must be an object, got "oops"'),
    ("export", lambda d: {k: v for k, v in d.items() if k != "decode"}, "decode is missing"),
])
def test_a_manifest_of_the_wrong_shape(tmp_path: Path, tiny_llama: Built, manifest: str, change: Any,
                                       words: str) -> None:
    src, name = ((tiny_llama.engine_dir, ENGINE_MANIFEST) if manifest == "engine"
                 else (tiny_llama.export_dir, EXPORT_MANIFEST))
    folder = _copy(src, tmp_path / manifest)
    (folder / name).write_text(json.dumps(change(json.loads((folder / name).read_text()))))
    if manifest == "engine":
        _assert_user_error(_cli("run", folder, "hi"), name, words)
    else:
        _assert_user_error(_cli("build", folder, "-o", tmp_path / "out"), name, words)


@pytest.mark.parametrize(("file", "text", "words"), [
    ("config.json", "[1]", "config.json must hold a JSON object, got list"),  # was AttributeError: .get
    ("tokenizer.json", '{"broken', "cannot be loaded (JSONDecodeError"),  # was the tokenizers' traceback
    ("tokenizer_config.json", '{"x": 1', "cannot be loaded (JSONDecodeError"),
])
def test_a_model_folder_with_a_damaged_file(tmp_path: Path, tiny_llama: Built, file: str, text: str,
                                            words: str) -> None:
    model = _copy(tiny_llama.hf_dir, tmp_path / "model")
    (model / file).write_text(text)
    _assert_user_error(_cli("export", model, "-o", tmp_path / "export"), str(model), words)
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize(("template", "error"), [
    ("{{ 'a' * 10**19 }}", "OverflowError"),
    ("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}", "TypeError"),
])
def test_a_chat_template_that_raises(tmp_path: Path, tiny_llama: Built, template: str, error: str) -> None:
    path = tmp_path / "bad.jinja"
    path.write_text(template)
    _assert_user_error(_cli("run", tiny_llama.engine_dir, "hi", "--chat-template", path), str(path), error)


def test_a_tiny_temperature_runs_greedy(tiny_llama: Built) -> None:
    greedy = _cli("run", tiny_llama.engine_dir, "hi", "--max-tokens", "5", "--temperature", "0")
    tiny = _cli("run", tiny_llama.engine_dir, "hi", "--max-tokens", "5", "--temperature", "1e-50")
    assert tiny.exit_code == 0 and "Traceback" not in tiny.output, tiny.output
    assert tiny.stdout == greedy.stdout


def test_a_repetition_penalty_float32_cannot_carry(tiny_llama: Built) -> None:
    _assert_user_error(_cli("run", tiny_llama.engine_dir, "hi", "--repetition-penalty", "1e-40"),
                       "repetition_penalty", "[0.01, 100]", "1e-40")


def test_serve_flags_out_of_range(tiny_llama: Built) -> None:
    _assert_user_error(_cli("serve", tiny_llama.engine_dir, "--max-request-bytes", "10"), "--max-request-bytes", "10")
    result = CliRunner().invoke(app, ["serve", str(tiny_llama.engine_dir)], env={"LLMC_API_KEY": " "})
    _assert_user_error(result, "LLMC_API_KEY")
