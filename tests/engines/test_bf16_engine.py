"""bf16 engines (`llmc build --dtype bfloat16`): every linear layer and the head through llmc's MatMulBF16 (half the
weight bytes), the rest of the graph fp32; logits within bf16's rounding of the fp32 export's, prompts (the AMX
path where the CPU grants it) and decode steps alike; and the choices it refuses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import Built

from llmc.engines.ort.build import BuildConfig, build_ort, export_engine
from llmc.engines.registry import load_engine_dir
from llmc.errors import InputError
from llmc.manifest import load_export


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])  # biases-free / qk-norm, untied head / GeGLU, caps
def test_bf16_engine_follows_the_export(tiny_factory: Callable[[str], Built], tmp_path: Path, arch: str) -> None:
    built = tiny_factory(arch)
    manifest = build_ort(BuildConfig(built.export_dir, tmp_path / "bf16", dtype="bfloat16", allow_divergence=True))
    assert manifest.precision == "bfloat16" and manifest.settings.dtype == "bfloat16" and manifest.settings.llmc_ops
    graph = onnx.load(str(tmp_path / "bf16" / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulBF16") >= 4 * 2 + 1 and "MatMul" not in ops  # every linear layer and the head
    tiles = [i for i in graph.initializer if i.name.endswith((".bf16tiles", ".bf16tiles_gated"))]
    assert len(tiles) == ops.count("MatMulBF16") and all(i.data_type == onnx.TensorProto.BFLOAT16 for i in tiles)
    gated = [n for n in graph.node if n.op_type == "MatMulBF16" and any(a.name == "gated" and a.i for a in n.attribute)]
    swiglu = arch != "gemma2"  # SwiGLU MLPs: silu(x @ gate) * (x @ up) in the product's epilogue (GeGLU: not)
    assert len(gated) == (2 if swiglu else 0)
    assert "SkipRMSNorm" in ops and "SkipSimplifiedLayerNormalization" not in ops  # llmc's residual norms
    engine, reference = load_engine_dir(tmp_path / "bf16"), export_engine(load_export(built.export_dir),
                                                                          built.export_dir)
    prompt = np.random.default_rng(3).integers(3, 200, 21).tolist()  # 21 rows: the tiles, and their tail
    kv, ref_kv = engine.new_kv_cache(1, 32), reference.new_kv_cache(1, 32)
    ours, theirs = engine.prefill([0], [prompt], kv)[0], reference.prefill([0], [prompt], ref_kv)[0]
    for token in (5, 9, 11):  # one-row decode steps: the AVX-512 path
        ours = np.stack([ours, engine.decode([0], [[token]], kv)[0]])[-1]
        theirs = np.stack([theirs, reference.decode([0], [[token]], ref_kv)[0]])[-1]
        scale = float(np.abs(theirs).max())
        assert float(np.abs(ours - theirs).max()) < 0.05 * scale
        assert np.corrcoef(ours, theirs)[0, 1] > 0.999


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"quant": "int4"}, "--dtype bfloat16 is the weights' precision: it takes neither --quant"),
    ({"kv_layout": "concat"}, "neither --quant nor --kv-layout concat"),
    ({"dtype": "float64"}, "--dtype must be one of auto, float32, bfloat16, got 'float64'"),
])
def test_bf16_refuses_what_it_does_not_combine_with(tiny_llama: Built, tmp_path: Path, kwargs: dict[str, str],
                                                    match: str) -> None:
    with pytest.raises(InputError, match=match):
        build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "e", **{"dtype": "bfloat16", **kwargs}))
