"""What llmc asks of TensorRT and CUDA, checked on the CPU against recording stand-ins (tests/trt/fake_tensorrt.py,
fake_cuda.py): the builder's network flags and preview features on 10.x and 11.x, the graphs handed to the parser
(static KV sequence axis; the native lowering over the whole buffer), the Triton pin, the engine's alias check, the
stream handle and the CUDA graphs' lifetime. The real calls run in test_trt_engine.py on a GPU."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import pytest
from runtime.fake_engine import fake_manifest

from llmc.engines.ort.build import BuildConfig
from llmc.engines.trt import run as trt_run
from llmc.engines.trt.build import (
    TRITON_PIN,
    TrtBuildConfig,
    _TrtBuilder,
    build_plans,
    check_triton,
    require_triton,
)
from llmc.engines.trt.profiles import TrtLimits, plan_profiles
from llmc.engines.trt.run import TrtKVCache, _TrtGraph, check_aliases, stream_handle
from llmc.errors import BackendUnavailableError, EngineError
from llmc.graph import io_names as io
from llmc.manifest import EngineSettings, load_export
from llmc.progress import Quiet

from .fake_cuda import FakeCudart, FakeEngine, FakeRuntime, FakeStream, FakeTrtModule
from .fake_tensorrt import fake_tensorrt
from .test_profiles import MODEL

LIMITS = TrtLimits(max_batch_size=2, max_input_len=16, max_seq_len=128, max_num_tokens=4)


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("attention", ["plugin", "native"])
@pytest.mark.parametrize("version", ["10.13.3", "11.4.0"])
def test_builder_hands_tensorrt_strongly_typed_static_graphs(tiny_llama, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, version: str,
                                                             attention: str) -> None:
    trt, rec = fake_tensorrt(version)
    monkeypatch.setattr("llmc.engines.trt.plugin.register_trt_plugin", lambda: None)  # needs tensorrt.plugin
    export = load_export(tiny_llama.export_dir)
    cfg = TrtBuildConfig(BuildConfig(tiny_llama.export_dir, tmp_path / "engine", backend="trt"), LIMITS,
                         attention=attention)
    work = tmp_path / "work"
    work.mkdir()
    kv, _, _, _ = build_plans(work, export, cfg, _TrtBuilder(trt, b"", attention), Quiet())

    # 4: strongly typed on every release, nothing of the weakly typed route (flags, layer precision, pinning)
    assert [c[1] for c in rec.calls if c[0] == "create_network"] == [1, 1]  # 1 << STRONGLY_TYPED
    assert not {"set_flag", "layer.precision", "layer.set_output_type"} & set(rec.names())
    # 1: the plugin's aliased K/V outputs need the preview feature; the native build has no plugin
    previews = [c[2] for c in rec.calls if c[0] == "build_serialized_network"]
    want = {trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03: True} if attention == "plugin" else {}
    assert previews == [want, want]
    past, present = set(kv.names("past")), set(kv.names("present"))
    for graph in ("prefill", "decode"):
        model = onnx.load_model_from_string((work / f"{graph}.plan").read_bytes())  # the fake's plan: the graph
        # 2: the KV buffers' sequence axis is the static --max-seq-len, batch stays dynamic
        tensors = {v.name: _dims(v) for v in (*model.graph.input, *model.graph.output) if v.name in past | present}
        assert set(tensors) == past | present
        assert all(d[0] == io.BATCH and d[2] == LIMITS.max_seq_len for d in tensors.values()), tensors
        producers = {out: n for n in model.graph.node for out in n.output}
        ops = [n.op_type for n in model.graph.node]
        if attention == "plugin":
            assert ops.count("attention") == export.model.num_layers and "Attention" not in ops
        else:  # 3: Attention reads the whole written buffer, no slice to a data-dependent length
            attn = [n for n in model.graph.node if n.op_type == "Attention"]
            assert len(attn) == export.model.num_layers
            assert all(producers[n.input[1]].op_type == "TensorScatter" for n in attn)
            assert all(producers[n.input[2]].op_type == "TensorScatter" for n in attn)
    profile = next(c[1] for c in rec.calls if c[0] == "add_optimization_profile")
    assert profile[io.PAST_KEY.format(i=0)][0][2] == profile[io.PAST_KEY.format(i=0)][2][2] == LIMITS.max_seq_len


def test_a_tensorrt_without_the_aliasing_preview_is_a_clear_error(tmp_path: Path) -> None:
    trt, _ = fake_tensorrt("10.13.3")
    trt.PreviewFeature = type("PreviewFeature", (), {})  # type: ignore[attr-defined]
    kv = io.kv_spec(MODEL, "float16", layout="inplace")
    profile = plan_profiles(LIMITS, *io.inplace_specs(MODEL, kv, "onnx"))["decode"]
    with pytest.raises(BackendUnavailableError, match=r"TensorRT 10.13.3 has no PreviewFeature"
                                                      r".ALIASED_PLUGIN_IO_10_03"):
        _TrtBuilder(trt, b"", "plugin").config(profile)
    _TrtBuilder(trt, b"", "native").config(profile)  # no plugin: no aliasing asked for


def test_triton_is_pinned() -> None:
    pin = ".".join(map(str, TRITON_PIN))
    check_triton(f"{pin}.0")
    check_triton(f"{pin}.2+git1234")
    with pytest.raises(BackendUnavailableError, match=rf"compiles its kernel with Triton {pin}.x, this machine has "
                                                      rf"Triton 3.2.0: pip install 'triton=={pin}.\*'"):
        check_triton("3.2.0")
    with pytest.raises(BackendUnavailableError, match=r"Triton 9.0.0"):
        check_triton("9.0.0")
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert pyproject.count(f'"triton=={pin}.*"') >= 3  # the trt, gpu and dev extras install the pinned release
    require_triton()  # this environment runs the kernel tests (interpreter) with the pinned Triton


# -- the engine side: alias check, stream handle, CUDA graphs per binding ------------------------------------------

@pytest.fixture(autouse=True)
def _no_cuda_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    """FakeStream stands for a cudaStream_t of a cuda-bindings without the native-handle helper, also on a GPU
    machine where the real cuda-bindings (whose helper refuses a FakeStream) is installed."""
    monkeypatch.setitem(sys.modules, "cuda.bindings.utils", None)  # type: ignore[arg-type]

def _manifest(attention: str = "plugin"):  # type: ignore[no-untyped-def]
    kv = io.kv_spec(MODEL, "float16", layout="inplace")
    prefill, decode = io.inplace_specs(MODEL, kv, "onnx")
    return replace(fake_manifest(), backend="trt", model=MODEL, kv=kv, prefill=prefill, decode=decode,
                   settings=EngineSettings(attention=attention))


def test_present_must_alias_past() -> None:
    kv = _manifest().kv
    past, present = kv.names("past"), kv.names("present")
    engine = FakeEngine([], [], {}, [], dict(zip(present, past)))
    check_aliases("decode.plan", engine, past, present, "plugin")
    check_aliases("decode.plan", FakeEngine([], [], {}, [], None), past, present, "plugin")  # no getter: no check
    with pytest.raises(EngineError, match=r"decode.plan: output present.0.key is not aliased to input "
                                          r"past_key_values.0.key \(TensorRT reports None\).*ALIASED_PLUGIN_IO_10_03"):
        check_aliases("decode.plan", FakeEngine([], [], {}, [], {}), past, present, "plugin")


def test_stream_handle_uses_the_native_getter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert stream_handle(FakeStream()) == 0xABC  # no native-handle helper: getPtr(), never int()
    utils = ModuleType("cuda.bindings.utils")
    utils.get_cuda_native_handle = lambda s: 0xDEF  # type: ignore[attr-defined]
    for name, module in (("cuda", ModuleType("cuda")), ("cuda.bindings", ModuleType("cuda.bindings")),
                         ("cuda.bindings.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    assert stream_handle(FakeStream()) == 0xDEF


@pytest.fixture()
def graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    rt = FakeCudart()
    monkeypatch.setattr(trt_run, "cudart", lambda: rt)
    manifest = _manifest()
    profile = plan_profiles(LIMITS, manifest.prefill, manifest.decode)["decode"]
    inputs, outputs = manifest.decode.input_names(), manifest.decode.output_names()
    shapes = {name: (r.min, r.opt, r.max) for name, r in profile.inputs.items()}
    aliases = dict(zip(manifest.kv.names("present"), manifest.kv.names("past")))
    engine = FakeEngine(inputs, outputs, shapes, rt.calls, aliases)
    (tmp_path / "decode.plan").write_bytes(b"plan")
    g = _TrtGraph(FakeTrtModule(), FakeRuntime(engine), tmp_path / "decode.plan", profile, manifest, FakeStream(),
                  LIMITS.max_batch_size * 4, LIMITS.max_batch_size * 4)
    kv = TrtKVCache(manifest, 4, 128, LIMITS.max_seq_len)
    return g, kv, rt


def _step(g: _TrtGraph, kv: TrtKVCache, first: int, batch: int) -> None:
    ids = np.zeros((batch, 1), np.int64)
    kv_shape = (batch, MODEL.num_kv_heads, LIMITS.max_seq_len, MODEL.head_dim)
    shapes = {io.INPUT_IDS: ids.shape, io.POSITION_IDS: ids.shape, **{n: kv_shape for n in kv.names}}
    g.run(kv, first, ids, ids.copy(), 1, shapes)


def test_cuda_graphs_belong_to_the_binding_they_were_captured_under(graph) -> None:  # type: ignore[no-untyped-def]
    g, kv, rt = graph
    events = lambda: [c for c in rt.calls if c[0] in ("execute", "launch", "destroy", "begin_capture")]  # noqa: E731
    _step(g, kv, 0, 2)  # plain run after binding
    _step(g, kv, 0, 2)  # captured, then replayed
    _step(g, kv, 0, 2)  # replayed
    assert events() == [("execute", 0xABC), ("begin_capture",), ("execute", 0xABC), ("launch", "exec0"),
                        ("launch", "exec0")]
    rt.calls.clear()
    _step(g, kv, 0, 3)  # another shape: the context is re-bound, the old capture destroyed
    _step(g, kv, 0, 3)
    assert events() == [("destroy", "exec0"), ("execute", 0xABC), ("begin_capture",), ("execute", 0xABC),
                        ("launch", "exec1")]
    rt.calls.clear()
    _step(g, kv, 0, 2)  # back to the first shape: not a replay of a capture made under another binding
    assert events() == [("destroy", "exec1"), ("execute", 0xABC)]
    assert [c for c in rt.calls if c[0] == "set_input_shape"][0][2] == (2, 1)
    _step(g, kv, 0, 2)
    g.close()  # every capture is freed
    assert rt.created == rt.destroyed == ["exec0", "exec1", "exec2"]


def test_an_engine_without_aliased_kv_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = FakeCudart()
    monkeypatch.setattr(trt_run, "cudart", lambda: rt)
    manifest = _manifest()
    profile = plan_profiles(LIMITS, manifest.prefill, manifest.decode)["decode"]
    shapes = {name: (r.min, r.opt, r.max) for name, r in profile.inputs.items()}
    engine = FakeEngine(manifest.decode.input_names(), manifest.decode.output_names(), shapes, rt.calls, {})
    (tmp_path / "decode.plan").write_bytes(b"plan")
    with pytest.raises(EngineError, match=r"decode.plan: output present.0.key is not aliased"):
        _TrtGraph(FakeTrtModule(), FakeRuntime(engine), tmp_path / "decode.plan", profile, manifest, FakeStream(), 8, 8)
