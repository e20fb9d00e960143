"""The lowered graphs (one llmc::attention node per layer) run by ONNX Runtime with the reference op give the logits
of the un-lowered in-place "onnx" graphs, of the "onnx" ORT engine and of the export, through the TensorRT engine's
own step logic (SlotSteps). CPU only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime_extensions  # noqa: E402,F401  (dev extra: runs the reference plugin op; no skip)
import pytest

from llmc.engines.base import Engine
from llmc.engines.ort.build import export_engine
from llmc.engines.registry import load_engine_dir
from llmc.engines.trt.lower import PLUGIN_NAME, PLUGIN_NAMESPACE, find_attention_blocks, lower_graph
from llmc.engines.trt.profiles import TrtLimits
from llmc.errors import LimitError, LlmcError
from llmc.manifest import load_export

from .plugin_engine import OrtPluginEngine, session, write_graphs

TOL = 1e-4
PROMPTS = [[5, 17, 33, 9, 100, 42, 7], [11, 12], [200, 3, 4, 90]]  # different lengths: right padding
LIMITS = TrtLimits(max_batch_size=4, max_input_len=64, max_seq_len=128, max_num_tokens=8)


@pytest.fixture(scope="module")
def graphs(tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trt-lower")
    write_graphs(tiny_llama.export_dir, root / "inplace", lowered=False)
    write_graphs(tiny_llama.export_dir, root / "lowered", lowered=True)
    return root / "inplace", root / "lowered"


def test_one_plugin_node_per_layer(tiny_llama, graphs: tuple[Path, Path]) -> None:
    model = load_export(tiny_llama.export_dir).model
    for name in ("prefill", "decode"):
        proto = onnx.load(str(graphs[1] / f"{name}.onnx"), load_external_data=False)
        ops = [n.op_type for n in proto.graph.node]
        assert ops.count(PLUGIN_NAME) == model.num_layers
        assert not {"TensorScatter", "Attention", "Slice", "Range", "LessOrEqual"} & set(ops)
        node = next(n for n in proto.graph.node if n.op_type == PLUGIN_NAME)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.domain == PLUGIN_NAMESPACE and attrs["plugin_namespace"] == b"llmc" and attrs["aot"] == 1
        assert (attrs["num_heads"], attrs["kv_num_heads"], attrs["head_dim"]) == (4, 2, 16)
        assert attrs["scale"] == pytest.approx(16 ** -0.5) and attrs["block_m"] == (64 if name == "prefill" else 16)
        assert attrs["window"] == 0 and attrs["softcap"] == 0.0  # full attention, no softcap: the kernel's "off"
        assert list(node.input)[3:] == ["past_key_values.0.key", "past_key_values.0.value", "position_ids"]
        assert list(node.output)[1:] == ["present.0.key", "present.0.value"]
        assert any(o.domain == "llmc" for o in proto.opset_import)


def test_lowering_refuses_other_graphs(tiny_llama) -> None:
    export = load_export(tiny_llama.export_dir)
    proto = onnx.load(str(tiny_llama.export_dir / "decode.onnx"), load_external_data=False)  # concat layout
    assert find_attention_blocks(proto.graph) == []
    with pytest.raises(LlmcError, match="position_ids|expected one per layer"):
        lower_graph(proto.graph, export.model, "decode")


def _plugin_attrs(graph: onnx.GraphProto) -> list[dict[str, object]]:
    return [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in graph.node
            if n.op_type == PLUGIN_NAME]


def test_plugin_nodes_carry_each_layers_window_softcap_and_scale(tiny_llama, graphs: tuple[Path, Path]) -> None:
    """Windows come from the model by layer; softcap and scale from the Attention node (softcap: else the model)."""
    model = replace(load_export(tiny_llama.export_dir).model, layer_types=("sliding_attention", "full_attention"),
                    sliding_window=8, attn_softcap=30.0)
    proto = onnx.load(str(graphs[0] / "decode.onnx"), load_external_data=False)
    attention = [n for n in proto.graph.node if n.op_type == "Attention"]
    assert len(attention) == model.num_layers == 2
    attention[1].attribute.extend([onnx.helper.make_attribute("softcap", 5.0)])
    for a in attention[1].attribute:
        if a.name == "scale":
            a.f = 0.375
    lower_graph(proto.graph, model, "decode")
    attrs = _plugin_attrs(proto.graph)
    assert [(a["window"], a["softcap"]) for a in attrs] == [(8, 30.0), (0, 5.0)]
    assert [a["scale"] for a in attrs] == [pytest.approx(0.25), 0.375]


def test_blocks_out_of_layer_order_are_refused(tiny_llama, graphs: tuple[Path, Path]) -> None:
    proto = onnx.load(str(graphs[0] / "decode.onnx"), load_external_data=False)
    nodes = list(proto.graph.node)[::-1]  # the last layer's block is found first: its window would be layer 0's
    proto.graph.ClearField("node")
    proto.graph.node.extend(nodes)
    with pytest.raises(LlmcError, match=r"block 0 writes past_key_values.1.key.*not in layer order"):
        lower_graph(proto.graph, load_export(tiny_llama.export_dir).model, "decode")


def _feeds(sess: object, ids: np.ndarray, pos: np.ndarray, caches: list[np.ndarray]) -> dict[str, np.ndarray]:
    names = [i.name for i in sess.get_inputs() if i.name.startswith("past")]  # type: ignore[attr-defined]
    return {"input_ids": ids, "position_ids": pos, **dict(zip(names, caches))}


def test_graph_parity_prefill_then_decode(graphs: tuple[Path, Path]) -> None:
    """Same feeds through both graph pairs (no engine): logits and caches agree at every step."""
    plain = {g: session(graphs[0] / f"{g}.onnx") for g in ("prefill", "decode")}
    lowered = {g: session(graphs[1] / f"{g}.onnx") for g in ("prefill", "decode")}
    lens = np.array([len(p) for p in PROMPTS])
    ids = np.zeros((3, lens.max()), np.int64)
    pos = np.zeros_like(ids)
    for b, p in enumerate(PROMPTS):
        ids[b, : len(p)], pos[b, : len(p)] = p, np.arange(len(p))
    caches = [np.zeros((3, 2, 32, 16), np.float32) for _ in range(4)]
    a = plain["prefill"].run(None, _feeds(plain["prefill"], ids, pos, caches))  # type: ignore[attr-defined]
    b = lowered["prefill"].run(None, _feeds(lowered["prefill"], ids, pos, caches))  # type: ignore[attr-defined]
    for x, y in zip(a, b):
        assert np.abs(x - y).max() <= TOL
    caches = b[1:]
    for _ in range(3):
        next_ids = b[0][:, -1].argmax(-1)[:, None].astype(np.int64)
        step_pos = lens[:, None].astype(np.int64)
        a = plain["decode"].run(None, _feeds(plain["decode"], next_ids, step_pos, caches))  # type: ignore[attr-defined]
        b = lowered["decode"].run(None, _feeds(lowered["decode"], next_ids, step_pos, caches))  # type: ignore[attr-defined]
        for x, y in zip(a, b):
            assert np.abs(x - y).max() <= TOL
        caches, lens = b[1:], lens + 1


def _trace(engine: Engine, steps: int, tokens: list[list[int]] | None = None) -> tuple[np.ndarray, list[list[int]]]:
    """Prefill PROMPTS into slots 0..2, then `steps` decode steps (greedy unless tokens are given)."""
    kv = engine.new_kv_cache(3, 64)
    logits = [engine.prefill([0, 1, 2], PROMPTS, kv)]
    chosen = []
    for i in range(steps):
        step = tokens[i] if tokens else logits[-1].argmax(-1).tolist()
        chosen.append(step)
        logits.append(engine.decode([0, 1, 2], [[t] for t in step], kv))
    return np.stack(logits), chosen


def test_engine_parity_with_onnx_engine_and_export(tiny_llama, graphs: tuple[Path, Path]) -> None:
    candidate = OrtPluginEngine(tiny_llama.export_dir, graphs[1], LIMITS)
    ours, tokens = _trace(candidate, 4)
    onnx_engine, _ = _trace(load_engine_dir(tiny_llama.engine("onnx")), 4, tokens)
    export, _ = _trace(export_engine(load_export(tiny_llama.export_dir), tiny_llama.export_dir), 4, tokens)
    assert np.abs(ours - onnx_engine).max() <= TOL
    assert np.abs(ours - export).max() <= TOL


def test_limits_split_runs_without_changing_logits(tiny_llama, graphs: tuple[Path, Path]) -> None:
    """Batches wider than max_batch_size and chunks longer than max_num_tokens are split, with the same result."""
    wide = OrtPluginEngine(tiny_llama.export_dir, graphs[1], LIMITS)
    narrow = OrtPluginEngine(tiny_llama.export_dir, graphs[1],
                             TrtLimits(max_batch_size=2, max_input_len=16, max_seq_len=128, max_num_tokens=3))
    results = []
    for engine in (wide, narrow):
        kv = engine.new_kv_cache(4, 64)
        out = [engine.prefill([0, 2, 3], PROMPTS, kv)]  # slots 0 | 2, 3: two runs of consecutive slots
        out.append(engine.decode([1], [[7, 8, 9, 10, 11, 12, 13]], kv))  # a 7-token chunk into slot 1
        out.append(engine.decode([3, 0, 2, 1], [[4], [5], [6], [7]], kv))  # 4 rows, windows of 2
        results.append(np.concatenate(out))
    assert np.abs(results[0] - results[1]).max() <= TOL
    assert ("decode", 1, (1, 3)) in narrow.calls and ("decode", 0, (2, 1)) in narrow.calls
    assert all(shape[0] <= 2 for _, _, shape in narrow.calls)


def test_prompt_longer_than_the_profile_quotes_min_opt_max(tiny_llama, graphs: tuple[Path, Path]) -> None:
    engine = OrtPluginEngine(tiny_llama.export_dir, graphs[1],
                             TrtLimits(max_batch_size=2, max_input_len=4, max_seq_len=128))
    kv = engine.new_kv_cache(2, 64)
    with pytest.raises(LimitError, match=r"prefill input input_ids dimension 1 \(sequence\) is 7.*min 1 / opt 2 / "
                                         r"max 4.*--max-input-len"):
        engine.prefill([0], [PROMPTS[0]], kv)


@pytest.mark.slow
def test_smollm2_lowered_matches_the_export(smollm2, tmp_path: Path) -> None:
    """The real default model (grouped heads 9/3, D 64, 30 layers): same check as for the tiny llama."""
    write_graphs(smollm2.export_dir, tmp_path / "lowered", lowered=True)
    limits = TrtLimits(max_batch_size=4, max_input_len=64, max_seq_len=128, max_num_tokens=8)
    ours, tokens = _trace(OrtPluginEngine(smollm2.export_dir, tmp_path / "lowered", limits), 3)
    export, _ = _trace(export_engine(load_export(smollm2.export_dir), smollm2.export_dir), 3, tokens)
    assert np.abs(ours - export).max() <= 2e-4  # fp32 through 30 layers, logits up to ~40
