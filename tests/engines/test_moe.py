"""The MoE MLP block (llmc.graph.moe) in its four lowerings against transformers' own Mixtral, Qwen3-MoE, GPT-OSS,
GLM-4.5 and dots1 blocks and a float64 numpy reference, through ONNX Runtime: one-block graphs built with
GraphBuilder, tiny configs (hidden 32, 4 experts, top 2, expert width 32; GLM-4.5 / dots1: 8 experts in groups),
prompts and one-token decode rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper

from llmc.graph.builder import DTYPES, NP_DTYPES, GraphBuilder
from llmc.graph.moe import (
    CORRECTION_BIAS,
    DOWN,
    DOWN_BIAS,
    EXPERT_DOWN,
    EXPERT_DOWN_BIAS,
    EXPERT_GATE_UP,
    EXPERT_GATE_UP_BIAS,
    GATE_UP,
    GATE_UP_BIAS,
    LOWERINGS,
    MS,
    ORT_FC1,
    ORT_FC1_BIAS,
    ORT_FC2,
    QMOE_PARTS,
    ROUTER,
    ROUTER_BIAS,
    UP,
    MoESpec,
    canonical_from_hf,
    is_sparse_layer,
    moe_block,
    moe_spec,
    moe_weights,
    quantize_experts,
    spec_from_hf_config,
)
from llmc.graph.quant import _unpack
from llmc.manifest import ModelSpec

HIDDEN, EXPERTS, TOP_K, INTER = 32, 4, 2, 32  # (multiples of 32: QMoE's blocks)
SHAPES = [(1, 1), (3, 1), (1, 9), (2, 5)]  # [B, S]: decode rows and prompts
PREFIX = "layers.0.mlp"
FAMILIES = ("mixtral", "qwen3_norm", "qwen3_raw", "gpt_oss", "glm4_norm", "glm4_raw", "dots1", "ernie4_5_moe",
            "hunyuan", "deepseek_v2_grouped", "deepseek_v2_greedy")
# DeepSeek-V2's softmax routing: (experts, top k, topk_method, groups, groups kept, routed_scaling_factor)
DEEPSEEK_V2 = {"deepseek_v2_grouped": (8, 3, "group_limited_greedy", 4, 2, 1.5),  # (k > groups kept: they bite)
               "deepseek_v2_greedy": (8, 3, "greedy", 1, 1, 0.8)}
# sigmoid-routed families: (experts, top k, groups, groups kept, norm_topk_prob, routed_scaling_factor)
SIGMOID = {"glm4_norm": (8, 2, 4, 2, True, 2.5), "glm4_raw": (8, 2, 4, 2, False, 1.8),
           "dots1": (8, 3, 2, 1, True, 0.7)}


def moe_session(weights: Mapping[str, np.ndarray], spec: MoESpec, lowering: str, hidden: int, opset: int = 17,
                dtype: str = "float32", threads: int = 1, keep: tuple[str, ...] = (),
                accuracy_level: int = 0) -> ort.InferenceSession:
    """An ONNX Runtime session for one MoE block: input "h" [B, S, hidden], output "y"; the float arrays in `dtype`,
    those named in `keep` (under the block's prefix) in fp32 (quantized ones as they are)."""
    b = GraphBuilder(opset, dtype)
    b.output("Identity", [moe_block(b, "h", PREFIX, weights, spec, lowering, accuracy_level=accuracy_level)], "y")
    arrays = {**weights, **moe_weights(weights, PREFIX, lowering)}
    kept = {f"{PREFIX}.{name}" for name in keep}
    inits = [numpy_helper.from_array(arrays[n] if arrays[n].dtype == np.uint8 else
                                     arrays[n].astype(np.float32 if n in kept else NP_DTYPES[dtype]), n)
             for n in b.weights_used]
    io = [helper.make_tensor_value_info(n, DTYPES[dtype], ["B", "S", hidden]) for n in ("h", "y")]
    graph = helper.make_graph(b.nodes, "moe", io[:1], io[1:], initializer=list(b.constants.values()) + inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if lowering == "ort" else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=lowering != "ort")  # strict shape inference on standard ops
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def float64(weights: Mapping[str, np.ndarray], spec: MoESpec) -> dict[str, np.ndarray]:
    """The canonical arrays in float64, the biases zeros where the spec has none."""
    router, down = weights[f"{PREFIX}.{ROUTER}"], weights[f"{PREFIX}.{DOWN}"]
    zeros = {ROUTER_BIAS: router.shape[1:], GATE_UP_BIAS: (router.shape[1], 2 * spec.intermediate_size),
             DOWN_BIAS: down.shape[::2], CORRECTION_BIAS: router.shape[1:]}
    return {name: (weights[f"{PREFIX}.{name}"].astype(np.float64) if f"{PREFIX}.{name}" in weights
                   else np.zeros(zeros[name])) for name in (ROUTER, GATE_UP, DOWN, *zeros)}


def picks(logits: np.ndarray, correction: np.ndarray, spec: MoESpec) -> tuple[np.ndarray, np.ndarray]:
    """Float64 routing of logits [N, E] as transformers does it: each token's k picked experts [N, k] and their
    weights [N, k]."""
    k = spec.experts_per_token
    if spec.routing == "softmax_grouped":  # (DeepSeek-V2: the groups by their best probability)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        grouped = probs.reshape(len(probs), spec.num_groups, -1)
        best = np.argsort(-grouped.max(-1), axis=-1, kind="stable")[:, :spec.topk_groups]
        kept = np.zeros(grouped.shape[:2], bool)
        np.put_along_axis(kept, best, True, -1)
        top = np.argsort(-np.where(kept[..., None], grouped, 0.0).reshape(probs.shape), -1, kind="stable")[:, :k]
        w = np.take_along_axis(probs, top, -1)
        return top, w / (w.sum(-1, keepdims=True) if spec.norm_topk_prob else 1.0) * spec.routed_scaling
    if spec.routing != "sigmoid":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        choice = probs + correction if spec.routing == "softmax_biased" else probs  # (ERNIE 4.5: chosen biased)
        top = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(probs, top, -1)
        return top, w / (w.sum(-1, keepdims=True) if spec.norm_topk_prob else 1.0)
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + correction
    grouped = choice.reshape(len(choice), spec.num_groups, -1)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # [N, G]
    best = np.argsort(-group_scores, axis=-1, kind="stable")[:, :spec.topk_groups]
    kept = np.zeros(group_scores.shape, bool)
    np.put_along_axis(kept, best, True, -1)
    choice = np.where(kept[..., None], grouped, -np.inf).reshape(choice.shape)
    top = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, top, -1)
    if spec.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return top, w * spec.routed_scaling


def routed(h: np.ndarray, weights: Mapping[str, np.ndarray],
           spec: MoESpec) -> list[tuple[int, int, float, np.ndarray, np.ndarray]]:
    """Float64, as transformers routes (`picks`): each (token, expert) picked, as (token, expert, its routing weight,
    the expert's gate and up pre-activations)."""
    w64 = float64(weights, spec)
    x = h.reshape(-1, h.shape[-1]).astype(np.float64)
    tops, ws = picks(x @ w64[ROUTER] + w64[ROUTER_BIAS], w64[CORRECTION_BIAS], spec)
    out = []
    for t in range(x.shape[0]):
        for e, we in zip(tops[t], ws[t]):
            gate, up = np.split(x[t] @ w64[GATE_UP][e] + w64[GATE_UP_BIAS][e], 2)
            out.append((t, int(e), float(we), gate, up))
    return out


def reference(h: np.ndarray, weights: Mapping[str, np.ndarray], spec: MoESpec) -> np.ndarray:
    """The block in float64, token by token: `routed`, then each expert's activation and down (+ bias)."""
    w64 = float64(weights, spec)
    down, down_bias = w64[DOWN], w64[DOWN_BIAS]
    out = np.zeros((int(np.prod(h.shape[:-1])), h.shape[-1]))
    for t, e, we, gate, up in routed(h, weights, spec):
        if spec.activation == "silu":
            act = gate / (1 + np.exp(-gate)) * up
        else:
            g, u = np.minimum(gate, spec.limit), np.clip(up, -spec.limit, spec.limit)
            act = (u + 1) * g / (1 + np.exp(-spec.alpha * g))
        out[t] += we * (act @ down[e] + down_bias[e])
    return out.reshape(h.shape)


def clamped(h: np.ndarray, weights: Mapping[str, np.ndarray], spec: MoESpec) -> tuple[int, int]:
    """How many picked experts' gate values exceed the limit, and up values leave [-limit, limit]."""
    pre = routed(h, weights, spec)
    return (sum(int((gate > spec.limit).sum()) for *_, gate, _ in pre),
            sum(int((np.abs(up) > spec.limit).sum()) for *_, up in pre))


def run_block(block: torch.nn.Module, h: np.ndarray) -> np.ndarray:
    """transformers' block on h (GPT-OSS's returns its router scores too)."""
    with torch.no_grad():
        out = block(torch.from_numpy(h))
    return (out[0] if isinstance(out, tuple) else out).numpy()


# GPT-OSS's random weights: large enough gate / up pre-activations that the clamps at its limit 7 bite
GPT_OSS_SCALES = {"router.weight": 0.5, "router.bias": 0.5, "experts.gate_up_proj": 0.5,
                  "experts.gate_up_proj_bias": 1.0, "experts.down_proj": 0.03, "experts.down_proj_bias": 0.2}


def hf_block(family: str, seed: int = 0) -> tuple[torch.nn.Module, MoESpec]:
    """transformers' sparse MoE block with random weights (the router's too: Qwen3-MoE and GPT-OSS initialize it to
    zeros), GPT-OSS's biases too; GLM-4.5's and dots1's with a random correction bias, their shared experts' down
    projection zeros (they are the decoder's, not this block's: the block's output is then exactly its routed
    experts')."""
    scales = {"gate.weight": 0.5}
    if family in SIGMOID:
        from transformers import Dots1Config, Glm4MoeConfig
        from transformers.models.dots1.modeling_dots1 import Dots1MoE
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

        experts, k, groups, kept, norm, scaling = SIGMOID[family]
        kind: Any = (Dots1Config, Dots1MoE) if family == "dots1" else (Glm4MoeConfig, Glm4MoeMoE)
        config: Any = kind[0](hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=experts,
                              num_experts_per_tok=k, n_group=groups, topk_group=kept, norm_topk_prob=norm,
                              routed_scaling_factor=scaling, n_shared_experts=1)
        block: torch.nn.Module = kind[1](config)
        scales = {"gate.weight": 0.5, "shared_experts.down_proj.weight": 0.0}
        correction = torch.randn(experts, generator=torch.Generator().manual_seed(seed + 100)) * 0.3
        with torch.no_grad():  # (a buffer, not a parameter; about the scores' spread: `test_sigmoid_routing_picks`)
            block.get_buffer("gate.e_score_correction_bias").copy_(correction)
    elif family in DEEPSEEK_V2:
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

        experts, k, method, groups, kept, scaling = DEEPSEEK_V2[family]
        config = DeepseekV2Config(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=experts,
                                  num_experts_per_tok=k, topk_method=method, n_group=groups, topk_group=kept,
                                  routed_scaling_factor=scaling, n_shared_experts=1)
        block = DeepseekV2Moe(config)
        scales = {"gate.weight": 0.5, "shared_experts.down_proj.weight": 0.0}  # (its shared experts: the decoder's)
    elif family == "hunyuan":
        from transformers import HunYuanMoEV1Config
        from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1Moe

        config = HunYuanMoEV1Config(hidden_size=HIDDEN, intermediate_size=INTER, num_experts=EXPERTS, moe_topk=TOP_K)
        block = HunYuanMoEV1Moe(config)
        scales = {"gate.wg.weight": 0.5, "shared_mlp.down_proj.weight": 0.0}  # (its shared MLP is the decoder's)
    elif family == "ernie4_5_moe":
        from transformers import Ernie4_5_MoeConfig
        from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock

        config = Ernie4_5_MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, moe_num_experts=EXPERTS,
                                    moe_k=TOP_K, moe_num_shared_experts=0)
        block = Ernie4_5_MoeSparseMoeBlock(config)
        # the correction bias (a parameter here) about the probabilities' spread, so that it moves the choice
        scales = {"gate.weight": 0.5, "gate.moe_statics.e_score_correction_bias": 0.3}
    elif family == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                              num_experts_per_tok=TOP_K)
        block = GptOssMLP(config)
        scales = GPT_OSS_SCALES
    elif family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                               num_experts_per_tok=TOP_K)
        block = MixtralSparseMoeBlock(config)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                num_experts_per_tok=TOP_K, norm_topk_prob=family == "qwen3_norm")
        block = Qwen3MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scales.get(name, 0.2))
    return block.eval(), spec_from_hf_config(config)


def block_weights(block: torch.nn.Module) -> dict[str, np.ndarray]:
    """The block's canonical arrays (Hunyuan's router under the others' name first, as llmc/export/arch.py renames
    it)."""
    sd = {k.replace("gate.wg.", "gate."): v.detach().numpy() for k, v in block.state_dict().items()}
    return canonical_from_hf(sd, "", PREFIX)


def inputs() -> Iterator[np.ndarray]:
    """The blocks' inputs h [B, S, HIDDEN], one per SHAPES."""
    rng = np.random.default_rng(1)
    for shape in SHAPES:
        yield rng.standard_normal((*shape, HIDDEN)).astype(np.float32)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, MoESpec, dict[str, np.ndarray]]:
    block, spec = hf_block(request.param)
    return block, spec, block_weights(block)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_matches_transformers_and_reference(family: tuple[torch.nn.Module, MoESpec, dict[str, np.ndarray]],
                                            lowering: str) -> None:
    block, spec, weights = family
    session = moe_session(weights, spec, lowering, HIDDEN)
    clamps = np.zeros(2, int)
    for h in inputs():
        shape = h.shape[:-1]
        (y,) = session.run(None, {"h": h})
        expected = run_block(block, h)
        assert y.shape == h.shape
        assert np.abs(y - expected).max() <= 1e-5, (shape, np.abs(y - expected).max())
        assert np.abs(y - reference(h, weights, spec)).max() <= 1e-5, shape
        if spec.activation == "swiglu_oss":
            clamps += clamped(h, weights, spec)
    if spec.activation == "swiglu_oss":  # both clamps were exercised by the picked experts
        assert clamps.min() > 0, clamps


@pytest.mark.parametrize("routing", ["softmax", "sigmoid"])
@pytest.mark.parametrize("opset", [18, 21])
def test_standard_lowerings_across_opsets(opset: int, routing: str) -> None:
    """(Sigmoid routing's "ort" too: its routing is standard ops before the contrib op.)"""
    sigmoid = routing == "sigmoid"
    groups: dict[str, Any] = {"num_groups": 2, "topk_groups": 1, "routed_scaling": 1.5} if sigmoid else {}
    spec = MoESpec(EXPERTS, TOP_K, INTER, norm_topk_prob=False, routing=routing, **groups)
    rng = np.random.default_rng(3)
    weights = {f"{PREFIX}.{ROUTER}": rng.standard_normal((HIDDEN, EXPERTS)).astype(np.float32),
               f"{PREFIX}.{GATE_UP}": (rng.standard_normal((EXPERTS, HIDDEN, 2 * INTER)) * 0.2).astype(np.float32),
               f"{PREFIX}.{DOWN}": (rng.standard_normal((EXPERTS, INTER, HIDDEN)) * 0.2).astype(np.float32),
               **({f"{PREFIX}.{CORRECTION_BIAS}": (rng.standard_normal(EXPERTS) * 0.3).astype(np.float32)}
                  if sigmoid else {})}
    h = rng.standard_normal((2, 3, HIDDEN)).astype(np.float32)
    for lowering in ("standard", "loop", "dense", *(("ort",) if sigmoid else ())):
        (y,) = moe_session(weights, spec, lowering, HIDDEN, opset=opset).run(None, {"h": h})
        assert np.abs(y - reference(h, weights, spec)).max() <= 1e-5, lowering


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "hunyuan"])
def test_float16_graphs_route_in_float32(name: str) -> None:
    """fp16 graphs: logits in fp16 (as transformers in half precision), softmax / top-k in fp32."""
    block, spec = hf_block(name, seed=4)
    weights = block_weights(block)
    h = np.random.default_rng(5).standard_normal((2, 4, HIDDEN)).astype(np.float32)
    expected = reference(h, weights, spec)
    for lowering in LOWERINGS:
        (y,) = moe_session(weights, spec, lowering, HIDDEN, dtype="float16").run(None, {"h": h.astype(np.float16)})
        assert y.dtype == np.float16
        assert np.abs(y.astype(np.float32) - expected).max() <= 2e-2, lowering


@pytest.mark.parametrize("name", list(SIGMOID))
def test_sigmoid_routing_picks(name: str) -> None:
    """`picks` is transformers' router (GLM-4.5's, dots1's), and on the inputs every lowering is checked on, the
    correction bias and the group limit each change some token's experts (so that check covers both)."""
    block, spec = hf_block(name)
    weights = block_weights(block)
    w64 = float64(weights, spec)
    x = np.concatenate([h.reshape(-1, HIDDEN) for h in inputs()])
    logits = x.astype(np.float64) @ w64[ROUTER]
    top, w = picks(logits, w64[CORRECTION_BIAS], spec)
    with torch.no_grad():
        _, hf_w, hf_top = block.get_submodule("gate")(torch.from_numpy(x))
    order, hf_order = np.argsort(top, -1), np.argsort(hf_top.numpy(), -1)  # (transformers' top k is unsorted)
    np.testing.assert_array_equal(np.take_along_axis(top, order, -1), np.take_along_axis(hf_top.numpy(), hf_order, -1))
    np.testing.assert_allclose(np.take_along_axis(w, order, -1), np.take_along_axis(hf_w.numpy(), hf_order, -1),
                               rtol=1e-5)
    chosen = np.sort(top, -1)
    unbiased = np.sort(picks(logits, np.zeros(spec.num_experts), spec)[0], -1)
    ungrouped = np.sort(picks(logits, w64[CORRECTION_BIAS], dataclasses.replace(spec, topk_groups=spec.num_groups))[0],
                        -1)
    assert (chosen != unbiased).any(-1).sum() > 0 and (chosen != ungrouped).any(-1).sum() > 0


@pytest.mark.parametrize("router_fp32", [True, False])
@pytest.mark.parametrize("name", ["glm4_norm", "dots1"])
def test_float16_graphs_route_sigmoid_in_float32(name: str, router_fp32: bool) -> None:
    """fp16 graphs, "sigmoid" routing: all of it in fp32, the router's weight and correction bias stored in fp32
    (as transformers keeps them: MoESpec.float32_arrays) or in fp16 (cast up), the experts in fp16."""
    block, spec = hf_block(name, seed=4)
    weights = block_weights(block)
    keep = spec.float32_arrays() if router_fp32 else ()
    assert set(spec.float32_arrays()) == {ROUTER, CORRECTION_BIAS}
    seen = {n: a if n.removeprefix(f"{PREFIX}.") in keep else a.astype(np.float16).astype(np.float32)
            for n, a in weights.items()}  # the arrays as the graph stores them
    h = np.random.default_rng(5).standard_normal((2, 4, HIDDEN)).astype(np.float16)
    expected = reference(h.astype(np.float32), seen, spec)
    for lowering in LOWERINGS:
        session = moe_session(weights, spec, lowering, HIDDEN, dtype="float16", keep=keep)
        (y,) = session.run(None, {"h": h})
        assert y.dtype == np.float16
        assert np.abs(y.astype(np.float32) - expected).max() <= 2e-2, (lowering, np.abs(y - expected).max())


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


def test_bias_layouts() -> None:
    """GPT-OSS's interleaved [E, hidden, 2I] experts and their biases, canonical and per lowering."""
    rng = np.random.default_rng(7)
    hf = {"mlp.router.weight": rng.standard_normal((EXPERTS, HIDDEN)), "mlp.router.bias": rng.standard_normal(EXPERTS),
          "mlp.experts.gate_up_proj": rng.standard_normal((EXPERTS, HIDDEN, 2 * INTER)),
          "mlp.experts.gate_up_proj_bias": rng.standard_normal((EXPERTS, 2 * INTER)),
          "mlp.experts.down_proj": rng.standard_normal((EXPERTS, INTER, HIDDEN)),
          "mlp.experts.down_proj_bias": rng.standard_normal((EXPERTS, HIDDEN))}
    canon = canonical_from_hf(hf, "mlp.", PREFIX)
    assert set(canon) == {f"{PREFIX}.{n}" for n in (ROUTER, ROUTER_BIAS, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS)}
    gate_up, gate_up_bias = canon[f"{PREFIX}.{GATE_UP}"], canon[f"{PREFIX}.{GATE_UP_BIAS}"]
    np.testing.assert_array_equal(canon[f"{PREFIX}.{ROUTER}"], hf["mlp.router.weight"].T)
    np.testing.assert_array_equal(gate_up[:, :, :INTER], hf["mlp.experts.gate_up_proj"][:, :, 0::2])
    np.testing.assert_array_equal(gate_up[:, :, INTER:], hf["mlp.experts.gate_up_proj"][:, :, 1::2])
    np.testing.assert_array_equal(gate_up_bias[:, :INTER], hf["mlp.experts.gate_up_proj_bias"][:, 0::2])
    np.testing.assert_array_equal(gate_up_bias[:, INTER:], hf["mlp.experts.gate_up_proj_bias"][:, 1::2])
    np.testing.assert_array_equal(canon[f"{PREFIX}.{DOWN}"], hf["mlp.experts.down_proj"])
    np.testing.assert_array_equal(canon[f"{PREFIX}.{DOWN_BIAS}"], hf["mlp.experts.down_proj_bias"])
    per_expert = moe_weights(canon, PREFIX, "standard")
    assert len(per_expert) == 4 * EXPERTS
    np.testing.assert_array_equal(per_expert[f"{PREFIX}.{EXPERT_GATE_UP_BIAS.format(j=2)}"], gate_up_bias[2])
    np.testing.assert_array_equal(per_expert[f"{PREFIX}.{EXPERT_DOWN_BIAS.format(j=2)}"],
                                  canon[f"{PREFIX}.{DOWN_BIAS}"][2])
    extra = moe_weights(canon, PREFIX, "ort")  # fc1's bias back in transformers' interleaved order
    np.testing.assert_array_equal(extra[f"{PREFIX}.{ORT_FC1_BIAS}"], hf["mlp.experts.gate_up_proj_bias"])
    np.testing.assert_array_equal(extra[f"{PREFIX}.{ORT_FC1}"], hf["mlp.experts.gate_up_proj"].transpose(0, 2, 1))
    assert moe_weights(canon, PREFIX, "loop") == {} and moe_weights(canon, PREFIX, "dense") == {}


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
    with pytest.raises(ValueError, match="gelu"):
        MoESpec(4, 2, 24, activation="gelu")


def test_gpt_oss_specs() -> None:
    from transformers import GptOssConfig

    config = GptOssConfig(num_local_experts=32, num_experts_per_tok=4, intermediate_size=64, num_hidden_layers=3,
                          swiglu_limit=5.0)
    spec = spec_from_hf_config(config)
    assert spec == MoESpec(32, 4, 64, True, "swiglu_oss", 1.702, 5.0, True)
    assert all(is_sparse_layer(config, i) for i in range(3))
    m = ModelSpec("llama", "GptOssForCausalLM", 32, 3, 4, 2, 8, 64, 100, 128, "rms", 1e-5, "silu", "rope",
                  num_experts=32, experts_per_token=4, moe_intermediate_size=64, norm_topk_prob=True,
                  moe_activation="swiglu_oss", swiglu_alpha=1.702, swiglu_limit=5.0, moe_bias=True)
    assert moe_spec(m) == spec
    assert moe_spec(ModelSpec("llama", "MixtralForCausalLM", 32, 3, 4, 2, 8, 64, 100, 128, "rms", 1e-5, "silu",
                              "rope", num_experts=8, experts_per_token=2, moe_intermediate_size=64,
                              norm_topk_prob=True)) == MoESpec(8, 2, 64)


@pytest.mark.parametrize("alpha, limit, bad", [(0.0, 7.0, "alpha"), (-1.702, 7.0, "alpha"), (1.702, 0.0, "limit"),
                                               (1.702, float("inf"), "limit"), (float("nan"), 7.0, "alpha")])
def test_swiglu_oss_needs_a_finite_positive_alpha_and_limit(alpha: float, limit: float, bad: str) -> None:
    value = alpha if bad == "alpha" else limit
    with pytest.raises(ValueError, match=f"{bad}, got {value!r}"):
        MoESpec(4, 2, 24, activation="swiglu_oss", alpha=alpha, limit=limit)


def test_sigmoid_routed_specs() -> None:
    from transformers import Dots1Config, Glm4MoeConfig

    glm = Glm4MoeConfig(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=48, n_group=4,
                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=2,
                        num_hidden_layers=5)
    spec = spec_from_hf_config(glm)
    assert spec == MoESpec(16, 4, 48, True, "silu", routing="sigmoid", num_groups=4, topk_groups=2,
                           routed_scaling=2.5)
    assert [is_sparse_layer(glm, i) for i in range(5)] == [False, False, True, True, True]
    dots = Dots1Config(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, num_hidden_layers=3)
    assert spec_from_hf_config(dots) == MoESpec(8, 2, 24, False, "silu", routing="sigmoid")  # dots1's defaults
    assert all(is_sparse_layer(dots, i) for i in range(3))  # (first_k_dense_replace 0)
    m = ModelSpec("llama", "Glm4MoeForCausalLM", 32, 3, 4, 2, 8, 64, 100, 128, "rms", 1e-5, "silu", "rope",
                  num_experts=16, experts_per_token=4, moe_intermediate_size=48, norm_topk_prob=True,
                  moe_routing="sigmoid", moe_groups=4, moe_topk_groups=2, routed_scaling=2.5)
    assert moe_spec(m) == spec
    assert MoESpec(8, 2, 24).float32_arrays() == ()
    hf = {"mlp.gate.weight": np.ones((8, HIDDEN)), "mlp.gate.e_score_correction_bias": np.arange(8.0),
          "mlp.experts.gate_up_proj": np.ones((8, 2 * INTER, HIDDEN)),
          "mlp.experts.down_proj": np.ones((8, HIDDEN, INTER))}
    canon = canonical_from_hf(hf, "mlp.", PREFIX)
    np.testing.assert_array_equal(canon[f"{PREFIX}.{CORRECTION_BIAS}"], np.arange(8.0))
    assert set(canon) == {f"{PREFIX}.{n}" for n in (ROUTER, CORRECTION_BIAS, GATE_UP, DOWN)}


@pytest.mark.parametrize("fields, bad", [
    ({"routing": "tanh"}, "routing must be one of"),
    ({"routing": "softmax", "topk_groups": 1}, "softmax routing needs 1, 1, 1.0, got 4, 1, 1.0"),
    ({"routing": "softmax", "num_groups": 1, "topk_groups": 1, "routed_scaling": 2.5},
     "softmax routing needs 1, 1, 1.0, got 1, 1, 2.5"),
    ({"num_groups": 3}, "num_groups must divide num_experts 8, got 3"),
    ({"num_groups": 0}, "num_groups must divide num_experts 8, got 0"),
    ({"num_groups": 8, "topk_groups": 4}, "at least 2 experts a group, got 8 groups"),
    ({"topk_groups": 0}, r"topk_groups must be in \[1, 4\], got 0"),
    ({"topk_groups": 5}, r"topk_groups must be in \[1, 4\], got 5"),
    ({"experts_per_token": 5}, "experts_per_token must be at most the 2 kept groups' 4 experts, got 5"),
    ({"routed_scaling": 0.0}, "routed_scaling must be finite and positive, got 0.0"),
    ({"routed_scaling": -1.0}, "routed_scaling must be finite and positive, got -1.0"),
    ({"routed_scaling": float("inf")}, "routed_scaling must be finite and positive, got inf"),
    ({"routed_scaling": float("nan")}, "routed_scaling must be finite and positive, got nan"),
])
def test_sigmoid_routing_validation(fields: dict[str, Any], bad: str) -> None:
    """Each field named in the message with its value; the spec it departs from (8 experts in 4 groups, 2 kept, top 2,
    sigmoid routing) is valid."""
    args: dict[str, Any] = {"num_experts": 8, "experts_per_token": 2, "intermediate_size": 24, "routing": "sigmoid",
                            "num_groups": 4, "topk_groups": 2}
    MoESpec(**args)
    with pytest.raises(ValueError, match=bad):
        MoESpec(**{**args, **fields})


def test_ernie_routing_chooses_by_the_biased_probabilities() -> None:
    """ERNIE 4.5 picks by softmax + its correction bias but weighs by the softmax: on the inputs every lowering is
    checked on, the bias changes some token's experts (so the lowerings' agreement above tests the choice)."""
    block, spec = hf_block("ernie4_5_moe")
    weights = block_weights(block)
    w64 = float64(weights, spec)
    x = np.concatenate([h.reshape(-1, HIDDEN) for h in inputs()]).astype(np.float64)
    biased, _ = picks(x @ w64[ROUTER], w64[CORRECTION_BIAS], spec)
    plain, _ = picks(x @ w64[ROUTER], np.zeros_like(w64[CORRECTION_BIAS]), spec)
    assert spec.routing == "softmax_biased" and (np.sort(biased, -1) != np.sort(plain, -1)).any()


def dequantized_experts(weights: Mapping[str, np.ndarray], bits: int, block: int) -> dict[str, np.ndarray]:
    """The canonical arrays with the experts as QMoE reads `quantize_experts`' codes: (q - z) * s a block."""
    out = dict(weights)
    for fc, canonical in ((ORT_FC1, GATE_UP), (ORT_FC2, DOWN)):
        q, s, z = (weights[f"{PREFIX}.{fc}{p}"] for p in QMOE_PARTS)
        codes = _unpack(q, bits).astype(np.float64)
        zero = _unpack(z, bits)[..., :s.shape[-1]].astype(np.float64)
        e, n, k = codes.shape
        rows = ((codes.reshape(e, n, k // block, block) - zero[..., None]) * s[..., None]).reshape(e, n, k)
        out[f"{PREFIX}.{canonical}"] = (np.concatenate([rows[:, 0::2], rows[:, 1::2]], 1) if fc == ORT_FC1
                                        else rows).transpose(0, 2, 1)  # (fc1's rows interleaved gate / up)
    return out


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "glm4_norm", "hunyuan"])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_experts_run_on_qmoe_as_their_codes_say(name: str, bits: int) -> None:
    """The "ort" lowering over `quantize_experts`' arrays is com.microsoft.QMoE, and computes the block with the
    experts its codes stand for: 4-bit with fp32 activations (accuracy_level 0) within fp32 rounding of that float
    block, int8 activations (4-bit at level 4; 8-bit always) within their rounding; each code within half a step of
    the float weight it quantizes."""
    block, spec = hf_block(name)
    weights = block_weights(block)
    quantized = {**weights, **quantize_experts({**weights, **moe_weights(weights, PREFIX, "ort")}, PREFIX, bits, 32)}
    expected = dequantized_experts(quantized, bits, 32)
    step = {fc: quantized[f"{PREFIX}.{fc}{QMOE_PARTS[1]}"].max() for fc in (ORT_FC1, ORT_FC2)}
    for fc, canonical in ((ORT_FC1, GATE_UP), (ORT_FC2, DOWN)):
        error = np.abs(expected[f"{PREFIX}.{canonical}"] - weights[f"{PREFIX}.{canonical}"]).max()
        assert error <= step[fc] / 2 + 1e-6, (fc, error, step[fc])
    b = GraphBuilder(17, "float32")
    moe_block(b, "h", PREFIX, quantized, spec, "ort")
    assert [n.op_type for n in b.nodes if n.domain == MS] == ["QMoE"]
    assert f"{PREFIX}.{ORT_FC1}" not in b.weights_used and f"{PREFIX}.{ORT_FC2}" not in b.weights_used
    for level in (0, 4):
        session = moe_session(quantized, spec, "ort", HIDDEN, accuracy_level=level)
        exact = bits == 4 and level == 0
        for h in inputs():
            (y,) = session.run(None, {"h": h})
            want = reference(h, expected, spec)
            tol = 2e-5 if exact else 3e-2 * float(np.abs(want).max())
            assert np.abs(y - want).max() <= tol, (level, np.abs(y - want).max(), tol)


@pytest.mark.parametrize("block", [24, 8, 64])
def test_expert_blocks_qmoe_cannot_take_are_refused_naming_the_flag(block: int) -> None:
    """Not a power of 2, under 16, or not dividing the experts' input size (hidden 32): one line, not a reshape."""
    from llmc.errors import InputError

    module, _ = hf_block("mixtral")
    weights = block_weights(module)
    with pytest.raises(InputError, match=f"--block-size {block} must be a power of 2 >= 16 dividing the experts'"):
        quantize_experts({**weights, **moe_weights(weights, PREFIX, "ort")}, PREFIX, 4, block)


@pytest.mark.parametrize("arch", ["llama4_text", "phimoe", "kolibri1", "nemotron_h_moe", "jamba", "gemma4_moe",
                                  "jetmoe"])
def test_each_routing_and_expert_input_runs_on_every_lowering(tmp_path: Path, arch: str) -> None:
    """Llama 4's experts on inputs scaled by the top k logits' sigmoids, PhiMoE's sparsemixer, Kolibri-1's
    logit-biased choice, Nemotron-H's ungated experts, Jamba's (the top k of a softmax over every expert, not
    renormalized, among Mamba-1 layers), Gemma 4's (GeGLU experts beside the MLP, on their own norm of the block's
    input, the router on another) and JetMoE's (its bias after the mixture in each expert's down bias, beside its
    mixture of attention): each engine lowering gives transformers' logits (the export's check ran "loop");
    the com.microsoft.MoE one, which weights the experts' outputs and has no squared ReLU nor GeGLU, is refused for
    Llama 4's, Nemotron-H's and Gemma 4's by name."""
    import transformers as tf
    from tiny_models import make_model

    from llmc.engines.ort.build import build_ort
    from llmc.engines.ort.config import BuildConfig
    from llmc.engines.registry import load_engine_dir
    from llmc.errors import InputError
    from llmc.export.exporter import ExportConfig, export

    make_model(arch, tmp_path / "hf")
    export(ExportConfig(str(tmp_path / "hf"), tmp_path / "export"))
    model = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = np.random.default_rng(1).integers(3, 300, 24).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].numpy()
    for lowering in ("standard", "ort"):
        cfg = BuildConfig(tmp_path / "export", tmp_path / lowering, moe=lowering, attention="gqa")
        if lowering == "ort" and arch in ("llama4_text", "nemotron_h_moe", "gemma4_moe"):
            with pytest.raises(InputError, match="--moe ort"):
                build_ort(cfg)
            continue
        build_ort(cfg)
        engine = load_engine_dir(tmp_path / lowering)
        ours = engine.prefill([0], [ids], engine.new_kv_cache(1, 32))[0]
        assert float(np.abs(ours - ref).max()) <= 1e-4, lowering


@pytest.mark.parametrize("routing", ["sigmoid_logits", "sparsemixer"])
@pytest.mark.parametrize("scale_inputs", [False, True])
def test_graph_lowerings_agree_on_the_new_routings(routing: str, scale_inputs: bool) -> None:
    """The standard, loop and dense lowerings compute the same block for Kolibri-1's / Llama 4's routing and
    PhiMoE's, on outputs weighted or (Llama 4) inputs scaled (loop and standard are checked against transformers
    through whole models above and in the parity suite)."""
    spec = MoESpec(EXPERTS, 2, INTER, norm_topk_prob=routing == "sigmoid_logits" and not scale_inputs,
                   routing=routing, jitter_eps=0.2 if routing == "sparsemixer" else 0.0, scale_inputs=scale_inputs)
    rng = np.random.default_rng(7)
    weights = {f"{PREFIX}.{ROUTER}": rng.standard_normal((HIDDEN, EXPERTS)).astype(np.float32),
               f"{PREFIX}.{GATE_UP}": (rng.standard_normal((EXPERTS, HIDDEN, 2 * INTER)) * 0.2).astype(np.float32),
               f"{PREFIX}.{DOWN}": (rng.standard_normal((EXPERTS, INTER, HIDDEN)) * 0.2).astype(np.float32),
               **({f"{PREFIX}.{CORRECTION_BIAS}": rng.standard_normal(EXPERTS).astype(np.float32)}
                  if routing == "sigmoid_logits" else {})}
    h = rng.standard_normal((2, 5, HIDDEN)).astype(np.float32)
    outputs = {lowering: moe_session(weights, spec, lowering, HIDDEN).run(None, {"h": h})[0]
               for lowering in ("standard", "loop", "dense")}
    assert np.abs(outputs["loop"]).max() > 0.1
    for lowering in ("standard", "dense"):
        assert np.abs(outputs[lowering] - outputs["loop"]).max() <= 1e-5, lowering


@pytest.mark.parametrize("latent", [0, 16])
@pytest.mark.parametrize("lowering", [lowering for lowering in LOWERINGS if lowering != "ort"])
def test_ungated_experts_on_every_lowering(lowering: str, latent: int) -> None:
    """Nemotron-H's experts, down(relu(x @ up)^2), under DeepSeek-V3's router, against the float64 reference on
    each lowering but "ort" (com.microsoft.MoE has no squared ReLU), which refuses them by name; with `latent`, on a
    projection of the router's input (experts_in: Nemotron 3 Super's latent experts), their sum as wide."""
    from llmc.errors import InputError

    rng = np.random.default_rng(3)
    width = latent or HIDDEN
    spec = MoESpec(8, 2, INTER, True, "relu2", routing="sigmoid", num_groups=2, topk_groups=1, routed_scaling=1.5)
    arrays = {ROUTER: rng.normal(size=(HIDDEN, 8)), CORRECTION_BIAS: rng.normal(0.0, 0.3, 8),
              UP: 0.3 * rng.normal(size=(8, width, INTER)), DOWN: 0.3 * rng.normal(size=(8, INTER, width))}
    weights = {f"{PREFIX}.{n}": a.astype(np.float32) for n, a in arrays.items()}
    h = rng.normal(size=(2, 5, HIDDEN)).astype(np.float32)
    project = (rng.normal(size=(HIDDEN, width)) / np.sqrt(HIDDEN)).astype(np.float32)
    x = h.reshape(-1, HIDDEN).astype(np.float64)
    tops, ws = picks(x @ arrays[ROUTER], arrays[CORRECTION_BIAS], spec)
    xe = x @ project if latent else x
    ref = np.zeros((len(x), width))
    for t in range(len(x)):
        for e, w in zip(tops[t], ws[t]):
            ref[t] += w * (np.maximum(xe[t] @ arrays[UP][e], 0.0) ** 2) @ arrays[DOWN][e]
    if latent:
        b = GraphBuilder(17, "float32")
        experts_in = b.op("MatMul", "h", b.const(project))
        b.output("Identity", [moe_block(b, "h", PREFIX, weights, spec, lowering, experts_in=experts_in)], "y")
        arrays_all = {**weights, **moe_weights(weights, PREFIX, lowering)}
        inits = [numpy_helper.from_array(arrays_all[n], n) for n in b.weights_used]
        graph = helper.make_graph(b.nodes, "moe", [helper.make_tensor_value_info("h", DTYPES["float32"], None)],
                                  [helper.make_tensor_value_info("y", DTYPES["float32"], None)],
                                  initializer=list(b.constants.values()) + inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 10
        got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"h": h})[0]
    else:
        got = moe_session(weights, spec, lowering, HIDDEN).run(None, {"h": h})[0]
    assert got.shape == (2, 5, width)
    np.testing.assert_allclose(got.reshape(ref.shape), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    with pytest.raises(InputError, match="no squared ReLU for ungated experts"):
        moe_session(weights, spec, "ort", HIDDEN)
