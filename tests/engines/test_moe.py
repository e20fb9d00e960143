"""The MoE MLP block (llmc.graph.moe) in its four lowerings against transformers' own Mixtral and Qwen3-MoE blocks
and a float64 numpy reference, through ONNX Runtime: one-block graphs built with GraphBuilder, tiny configs (hidden
32, 4 experts, top 2, expert width 24), prompts and one-token decode rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper

from llmc.graph.builder import DTYPES, NP_DTYPES, GraphBuilder
from llmc.graph.moe import (
    DOWN,
    EXPERT_DOWN,
    EXPERT_GATE_UP,
    GATE_UP,
    LOWERINGS,
    MS,
    ORT_FC1,
    ORT_FC2,
    ROUTER,
    MoESpec,
    canonical_from_hf,
    is_sparse_layer,
    moe_block,
    moe_weights,
    spec_from_hf_config,
)

HIDDEN, EXPERTS, TOP_K, INTER = 32, 4, 2, 24
SHAPES = [(1, 1), (3, 1), (1, 9), (2, 5)]  # [B, S]: decode rows and prompts
PREFIX = "layers.0.mlp"
FAMILIES = ("mixtral", "qwen3_norm", "qwen3_raw")


def moe_session(weights: Mapping[str, np.ndarray], spec: MoESpec, lowering: str, hidden: int, opset: int = 17,
                dtype: str = "float32", threads: int = 1) -> ort.InferenceSession:
    """An ONNX Runtime session for one MoE block: input "h" [B, S, hidden], output "y"."""
    b = GraphBuilder(opset, dtype)
    b.output("Identity", [moe_block(b, "h", PREFIX, weights, spec, lowering)], "y")
    arrays = {**weights, **moe_weights(weights, PREFIX, lowering)}
    inits = [numpy_helper.from_array(arrays[n].astype(NP_DTYPES[dtype]), n) for n in b.weights_used]
    io = [helper.make_tensor_value_info(n, DTYPES[dtype], ["B", "S", hidden]) for n in ("h", "y")]
    graph = helper.make_graph(b.nodes, "moe", io[:1], io[1:], initializer=list(b.constants.values()) + inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if lowering == "ort" else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=lowering != "ort")  # strict shape inference on standard ops
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def reference(h: np.ndarray, weights: Mapping[str, np.ndarray], spec: MoESpec) -> np.ndarray:
    """The block in float64, token by token, as transformers routes: softmax, top-k, optional renormalization."""
    router, gate_up, down = (weights[f"{PREFIX}.{n}"].astype(np.float64) for n in (ROUTER, GATE_UP, DOWN))
    x = h.reshape(-1, h.shape[-1]).astype(np.float64)
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[:spec.experts_per_token]
        w = probs[t, top] / (probs[t, top].sum() if spec.norm_topk_prob else 1.0)
        for e, we in zip(top, w):
            gate, up = np.split(x[t] @ gate_up[e], 2)
            out[t] += we * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return out.reshape(h.shape)


def hf_block(family: str, seed: int = 0) -> tuple[torch.nn.Module, MoESpec]:
    """transformers' sparse MoE block with random weights (the router's too: Qwen3-MoE initializes it to zeros)."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config: Any = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                                    num_experts_per_tok=TOP_K)
        block: torch.nn.Module = MixtralSparseMoeBlock(config)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                num_experts_per_tok=TOP_K, norm_topk_prob=family == "qwen3_norm")
        block = Qwen3MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if name == "gate.weight" else 0.2))
    return block.eval(), spec_from_hf_config(config)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, MoESpec, dict[str, np.ndarray]]:
    block, spec = hf_block(request.param)
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    return block, spec, canonical_from_hf(sd, "", PREFIX)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_matches_transformers_and_reference(family: tuple[torch.nn.Module, MoESpec, dict[str, np.ndarray]],
                                            lowering: str) -> None:
    block, spec, weights = family
    session = moe_session(weights, spec, lowering, HIDDEN)
    rng = np.random.default_rng(1)
    for shape in SHAPES:
        h = rng.standard_normal((*shape, HIDDEN)).astype(np.float32)
        (y,) = session.run(None, {"h": h})
        with torch.no_grad():
            expected = block(torch.from_numpy(h)).numpy()
        assert y.shape == h.shape
        assert np.abs(y - expected).max() <= 1e-5, (shape, np.abs(y - expected).max())
        assert np.abs(y - reference(h, weights, spec)).max() <= 1e-5, shape


@pytest.mark.parametrize("opset", [18, 21])
def test_standard_lowerings_across_opsets(opset: int) -> None:
    spec = MoESpec(EXPERTS, TOP_K, INTER, norm_topk_prob=False)
    rng = np.random.default_rng(3)
    weights = {f"{PREFIX}.{ROUTER}": rng.standard_normal((HIDDEN, EXPERTS)).astype(np.float32),
               f"{PREFIX}.{GATE_UP}": (rng.standard_normal((EXPERTS, HIDDEN, 2 * INTER)) * 0.2).astype(np.float32),
               f"{PREFIX}.{DOWN}": (rng.standard_normal((EXPERTS, INTER, HIDDEN)) * 0.2).astype(np.float32)}
    h = rng.standard_normal((2, 3, HIDDEN)).astype(np.float32)
    for lowering in ("standard", "loop", "dense"):
        (y,) = moe_session(weights, spec, lowering, HIDDEN, opset=opset).run(None, {"h": h})
        assert np.abs(y - reference(h, weights, spec)).max() <= 1e-5, lowering


def test_float16_graphs_route_in_float32() -> None:
    """fp16 graphs: logits in fp16 (as transformers in half precision), softmax / top-k in fp32."""
    block, spec = hf_block("mixtral", seed=4)
    weights = canonical_from_hf({k: v.detach().numpy() for k, v in block.state_dict().items()}, "", PREFIX)
    h = np.random.default_rng(5).standard_normal((2, 4, HIDDEN)).astype(np.float32)
    expected = reference(h, weights, spec)
    for lowering in LOWERINGS:
        (y,) = moe_session(weights, spec, lowering, HIDDEN, dtype="float16").run(None, {"h": h.astype(np.float16)})
        assert y.dtype == np.float16
        assert np.abs(y.astype(np.float32) - expected).max() <= 2e-2, lowering


def test_weight_layouts() -> None:
    rng = np.random.default_rng(6)
    gate_up = rng.standard_normal((EXPERTS, HIDDEN, 2 * INTER)).astype(np.float32)
    down = rng.standard_normal((EXPERTS, INTER, HIDDEN)).astype(np.float32)
    canon = {f"{PREFIX}.{GATE_UP}": gate_up, f"{PREFIX}.{DOWN}": down}
    assert moe_weights(canon, PREFIX, "dense") == {} and moe_weights(canon, PREFIX, "loop") == {}
    per_expert = moe_weights(canon, PREFIX, "standard")
    assert len(per_expert) == 2 * EXPERTS
    np.testing.assert_array_equal(per_expert[f"{PREFIX}.{EXPERT_GATE_UP.format(j=3)}"], gate_up[3])
    np.testing.assert_array_equal(per_expert[f"{PREFIX}.{EXPERT_DOWN.format(j=3)}"], down[3])
    extra = moe_weights(canon, PREFIX, "ort")
    fc1, fc2 = extra[f"{PREFIX}.{ORT_FC1}"], extra[f"{PREFIX}.{ORT_FC2}"]
    assert fc1.shape == (EXPERTS, 2 * INTER, HIDDEN) and fc2.shape == (EXPERTS, HIDDEN, INTER)
    np.testing.assert_array_equal(fc1[:, 0::2, :], gate_up[:, :, :INTER].transpose(0, 2, 1))
    np.testing.assert_array_equal(fc1[:, 1::2, :], gate_up[:, :, INTER:].transpose(0, 2, 1))
    np.testing.assert_array_equal(fc2, down.transpose(0, 2, 1))
    with pytest.raises(ValueError, match="lowering"):
        moe_weights(canon, PREFIX, "cuda")


def test_specs_and_sparse_layers() -> None:
    from transformers import MixtralConfig, Qwen3MoeConfig

    mixtral = MixtralConfig(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)
    assert spec_from_hf_config(mixtral) == MoESpec(8, 2, 64, True, "silu")
    assert is_sparse_layer(mixtral, 0)
    qwen = Qwen3MoeConfig(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48, norm_topk_prob=False,
                          num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert spec_from_hf_config(qwen) == MoESpec(16, 4, 48, False, "silu")
    assert [is_sparse_layer(qwen, i) for i in range(6)] == [False, True, False, False, False, True]
    with pytest.raises(ValueError):
        MoESpec(4, 5, 24)
    with pytest.raises(ValueError):
        MoESpec(4, 2, 24, activation="gelu")
