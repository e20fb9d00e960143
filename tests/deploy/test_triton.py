"""`llmc package --target triton`: config.pbtxt read with Triton's own protobuf schema (tritonclient), and the
packaged model.py run against a stand-in for `triton_python_backend_utils`: requests in, streamed responses out."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmc.deploy.package import PackageConfig, Target, package
from llmc.runtime.config import RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.runtime.request import SamplingParams

from . import triton_stub as pb

NAME = "tiny"


@pytest.fixture(scope="module")
def repo(deploy_engine_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("triton") / "repo"
    package(PackageConfig(deploy_engine_dir, Target.triton, out, name=NAME, threads=1, kv_budget_mb=64, max_running=4))
    return out


def _model_config_pb2() -> Any:
    """tritonclient's ModelConfig schema, loaded alone: the `tritonclient.grpc` package also registers the KServe
    v2 service protos, which the kserve SDK (imported by other tests in this process) registers too."""
    if "tritonclient.grpc.model_config_pb2" in sys.modules:
        return sys.modules["tritonclient.grpc.model_config_pb2"]
    spec = importlib.util.find_spec("tritonclient")
    assert spec is not None and spec.origin is not None, "tritonclient is not installed (the dev extra has it)"
    path = Path(spec.origin).parent / "grpc" / "model_config_pb2.py"
    module_spec = importlib.util.spec_from_file_location("tritonclient.grpc.model_config_pb2", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    sys.modules["tritonclient.grpc.model_config_pb2"] = module
    return module


def _parse_config(repo: Path) -> Any:
    from google.protobuf import text_format

    text = (repo / "models" / NAME / "config.pbtxt").read_text()
    return text_format.Parse(text, _model_config_pb2().ModelConfig())


def test_config_pbtxt_is_a_decoupled_python_model(repo: Path) -> None:
    mc = _model_config_pb2()
    cfg = _parse_config(repo)
    assert (cfg.name, cfg.backend, cfg.max_batch_size) == (NAME, "python", 0)
    assert cfg.model_transaction_policy.decoupled
    inputs = {i.name: (i.data_type, list(i.dims), i.optional) for i in cfg.input}
    assert inputs["text_input"] == (mc.TYPE_STRING, [1], False)
    assert inputs["max_tokens"] == (mc.TYPE_INT32, [1], True)
    assert {o.name: o.data_type for o in cfg.output} == {"text_output": mc.TYPE_STRING, "finish_reason": mc.TYPE_STRING}
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(1, mc.ModelInstanceGroup.KIND_CPU)]
    assert cfg.parameters["engine_dir"].string_value == "engine"
    assert (repo / "models" / NAME / "1" / "engine" / "engine.json").is_file()
    assert (repo / "models" / NAME / "1" / "model.py").is_file()
    reqs = (repo / "requirements.txt").read_text()
    assert "onnxruntime==" in reqs and "torch" not in reqs and "fastapi" not in reqs
    docker = (repo / "Dockerfile").read_text()
    assert "COPY models/ /models/" in docker and 'CMD ["tritonserver", "--model-repository=/models"]' in docker
    assert (repo / "llmc-src" / "setup.py").is_file() and (repo / "llmc-src" / "llmc" / "deploy").is_dir()
    assert not list((repo / "llmc-src").rglob("*.so"))  # sources only: they compile for the image's Python


@pytest.fixture
def model(repo: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The packaged model.py, initialized as Triton does (model_config as JSON, the repository and version)."""
    from google.protobuf import json_format

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    spec = importlib.util.spec_from_file_location("triton_llmc_model", repo / "models" / NAME / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    m = module.TritonPythonModel()
    config = json_format.MessageToDict(_parse_config(repo), preserving_proto_field_name=True)
    m.initialize({"model_config": json.dumps(config), "model_repository": str(repo / "models" / NAME),
                  "model_version": "1",
                  "model_name": NAME, "model_instance_kind": "CPU", "model_instance_name": f"{NAME}_0"})
    yield m
    m.finalize()
    assert not m.thread.is_alive() and not m.engine.alive


def _request(i: int, prompt: str, **extra: Any) -> pb.Request:
    inputs = {"text_input": np.array([prompt.encode()], dtype=np.object_)}
    types = {"max_tokens": np.int32, "temperature": np.float32, "top_k": np.int32, "chat": np.bool_}
    inputs.update({k: np.array([v], dtype=types[k]) for k, v in extra.items()})
    return pb.Request(f"r{i}", inputs)


def _wait(requests: list[pb.Request], timeout: float = 60) -> None:
    for r in requests:
        assert r.done.wait(timeout), f"request {r.request_id()} got no final response"


@pytest.fixture(scope="module")
def reference(deploy_engine_dir: Path) -> LLM:
    """The same engine outside Triton (the model's own LLM belongs to its engine thread)."""
    return LLM(deploy_engine_dir, RuntimeConfig(threads=1, kv_budget_mb=64, max_running=4))


def test_streams_each_request_and_batches_across_them(model: Any, reference: LLM) -> None:
    batch_sizes: list[int] = []
    decode = model.llm.engine.decode

    def recording(slots: list[int], *args: Any, **kwargs: Any) -> Any:
        batch_sizes.append(len(slots))
        time.sleep(0.002)  # long enough steps that requests queued together run together
        return decode(slots, *args, **kwargs)

    model.llm.engine.decode = recording
    prompts = ["Hello there", "The capital of France is", "1 2 3 4", "Once upon a time"]
    requests = [_request(i, p, max_tokens=12, temperature=0.0) for i, p in enumerate(prompts)]
    assert model.execute(requests) is None  # decoupled: everything goes through the senders
    _wait(requests)
    expected = reference.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for r, out in zip(requests, expected):
        assert r.closed and not any(x.has_error() for x in r.responses)
        assert len(r.responses) > 1, "the text should stream as several responses"
        assert "".join(r.texts()) == out.outputs[0].text
        assert r.finish_reason() == "length"
    assert max(batch_sizes) > 1, f"Triton's requests never shared an engine step: {batch_sizes}"


def test_chat_input_applies_the_template(model: Any, reference: LLM) -> None:
    r = _request(0, "What is the capital of France?", max_tokens=5, chat=True, temperature=0.0)
    model.execute([r])
    _wait([r])
    ids = reference.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    want = reference.generate([ids], SamplingParams(max_tokens=5, temperature=0.0))[0].outputs[0].text
    assert "".join(r.texts()) == want


def test_bad_requests_get_one_final_error(model: Any) -> None:
    missing = pb.Request("m", {"max_tokens": np.array([4], dtype=np.int32)})
    too_long = _request(1, "hi", max_tokens=10**6)
    bad_temp = _request(2, "hi", max_tokens=4, temperature=-1.0)
    model.execute([missing, too_long, bad_temp])
    _wait([missing, too_long, bad_temp])
    for r, words in ((missing, "text_input"), (too_long, "exceeds the context"), (bad_temp, "temperature")):
        assert len(r.responses) == 1 and r.responses[0].has_error() and r.closed
        assert words in r.responses[0].error().message()  # type: ignore[union-attr]


_S = np.object_


@pytest.mark.parametrize(("inputs", "words"), [
    # each left its request without a final response (an exception in the model's loop): the client waited forever
    ({"max_tokens": np.array([], np.int32)}, "input 'max_tokens' must hold 1 value, got 0"),
    ({"max_tokens": np.array([np.nan], np.float32)}, "input 'max_tokens' must be an integer, got nan"),
    ({"max_tokens": np.array([b"12"], _S)}, "input 'max_tokens' must be an integer, got b'12'"),
    ({"chat": np.array([], np.bool_)}, "input 'chat' must hold 1 value, got 0"),
    ({"text_input": np.array([b"\xff\xfe"], _S)}, "input 'text_input' is not UTF-8 text"),
    # accepted: 2.7 ran as top_k 2, the string b'false' as chat, the number 5 as the prompt "5", [3, 4] as 3
    ({"top_k": np.array([2.7], np.float32)}, "input 'top_k' must be an integer, got 2.7"),
    ({"chat": np.array([b"false"], _S)}, "input 'chat' must be a bool (TYPE_BOOL), got b'false'"),
    ({"text_input": np.array([5], np.int32)}, "input 'text_input' must be a string (TYPE_STRING), got int32"),
    ({"max_tokens": np.array([3, 4], np.int32)}, "input 'max_tokens' must hold 1 value, got 2"),
])
def test_malformed_inputs_get_one_final_error(model: Any, inputs: dict[str, np.ndarray], words: str) -> None:
    bad = pb.Request("bad", {"text_input": np.array([b"hi"], _S), "max_tokens": np.array([4], np.int32), **inputs})
    good = _request(1, "hi", max_tokens=4)
    model.execute([bad, good])
    _wait([bad, good], timeout=20)
    assert len(bad.responses) == 1 and bad.responses[0].has_error() and bad.closed
    assert words in bad.responses[0].error().message()  # type: ignore[union-attr]
    assert good.finish_reason() in ("length", "stop")  # the other request in the batch is served
    assert not any(x.has_error() for x in good.responses)


def test_an_unexpected_failure_still_ends_the_request(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(model.llm.tokenizer, "encode", broken)
    r = _request(0, "hi", max_tokens=4)
    model.execute([r])
    _wait([r], timeout=20)
    assert len(r.responses) == 1 and r.responses[0].has_error() and r.closed
    assert "RuntimeError: tokenizer exploded" in r.responses[0].error().message()  # type: ignore[union-attr]


@pytest.mark.parametrize(("key", "value", "words"), [
    ("threads", "abc", "parameter 'threads' must be an integer, got 'abc'"),  # was int()'s ValueError
    ("kv_budget_mb", "1e3", "parameter 'kv_budget_mb' must be an integer, got '1e3'"),
    ("max_running", "9999", "parameter 'max_running' must be in [1, 512], got 9999"),
    ("max_queue", "-1", "parameter 'max_queue' must be >= 0, got -1"),  # was accepted
])
def test_bad_config_parameters_fail_loading_naming_them(repo: Path, monkeypatch: pytest.MonkeyPatch, key: str,
                                                        value: str, words: str) -> None:
    from google.protobuf import json_format

    from llmc.errors import InputError

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    spec = importlib.util.spec_from_file_location("triton_llmc_model", repo / "models" / NAME / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = json_format.MessageToDict(_parse_config(repo), preserving_proto_field_name=True)
    config["parameters"][key] = {"string_value": value}
    with pytest.raises(InputError) as e:
        module.TritonPythonModel().initialize({"model_config": json.dumps(config), "model_version": "1",
                                               "model_repository": str(repo / "models" / NAME)})
    assert words in str(e.value)


def test_a_cancelled_request_ends_and_frees_its_slot(model: Any) -> None:
    r = _request(0, "Count with me:", max_tokens=200, temperature=0.0)
    slow = model.llm.engine.decode
    model.llm.engine.decode = lambda *a, **k: (time.sleep(0.01), slow(*a, **k))[1]
    model.execute([r])
    deadline = time.monotonic() + 30
    while not r.responses and time.monotonic() < deadline:
        time.sleep(0.005)
    r.cancelled = True
    _wait([r])
    assert len(r.responses) < 200
    deadline = time.monotonic() + 10
    while model.engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model.engine.stats().running == 0
