"""The mixture-of-experts MLP block (transformers' Mixtral, Qwen2-MoE and Qwen3-MoE) as ONNX, in four lowerings.

Routing, as both families compute it: logits = h @ W_router (no bias; in the compute dtype), softmax over all
experts in fp32, top-k, then (Mixtral always, Qwen3-MoE when `norm_topk_prob`) the k weights divided by their sum.
Each selected expert is a SwiGLU MLP, down(silu(h @ gate) * (h @ up)), and the block's output is the
routing-weighted sum of its k experts' outputs.

Lowerings (all exact: what transformers computes, up to fp32 rounding):
  "standard"  standard ONNX ops, one unrolled branch per expert with its own 2-D weights (from `moe_weights`):
              the tokens that picked expert j (NonZero of its routing column: empty when none did) are gathered,
              run through its MLP, weighted and added into their output rows (GatherND + Add + ScatterND, in
              increasing expert order as transformers' loop). A MatMul over zero rows reads nothing, so a decode
              step reads only its k experts' weights, and a prompt runs each expert once over its own tokens.
              About 20 nodes per expert: for many experts (Qwen3-30B-A3B: 128) prefer "loop" or "ort".
  "loop"      standard ONNX ops, a fixed node count: an ONNX Loop over the experts some token picked, the same
              body as a "standard" branch, on the stacked weights. Gather copies each visited expert's matrices
              out of them (ONNX has no views), so a decode step moves its k experts' bytes about three times.
  "dense"     standard ONNX ops, no control flow and no data-dependent shapes (for runtimes without Loop /
              NonZero): every expert on every token, weighted by the [N, E] routing matrix (zero where unpicked).
  "ort"       ONNX Runtime's contrib op com.microsoft.MoE (its CPU kernel takes the router logits [N, E] and does
              the fp32 softmax, top-k and, with normalize_routing_weights=1, the renormalization itself, then runs
              only the selected experts). fc1 holds gate/up interleaved, [E, 2I, hidden] (row 2c gate column c,
              row 2c+1 up column c), fc2 the down weights [E, hidden, I] (both from `moe_weights`); `ORT_ATTRS`
              make its SwiGLU exactly silu(gate) * up.

Canonical weights (numpy, [in, out] like every llmc MatMul weight), under the block's prefix:
  router.weight [hidden, E], experts.gate_up.weight [E, hidden, 2I] (gate columns first), experts.down.weight
  [E, I, hidden]. `canonical_from_hf` maps a transformers 5.x state dict onto them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from llmc.graph.builder import NP_DTYPES, GraphBuilder
from llmc.graph.checkpoint import Checkpoint
from llmc.graph.layers import Ctx, linear
from llmc.manifest import ModelSpec

MS = "com.microsoft"
LOWERINGS = ("standard", "loop", "dense", "ort")

ROUTER = "router.weight"  # [hidden, E]
GATE_UP = "experts.gate_up.weight"  # [E, hidden, 2I]: columns [0, I) gate, [I, 2I) up
DOWN = "experts.down.weight"  # [E, I, hidden]
EXPERT_GATE_UP = "experts.{j}.gate_up.weight"  # "standard": expert j's [hidden, 2I]
EXPERT_DOWN = "experts.{j}.down.weight"  # "standard": expert j's [I, hidden]
ORT_FC1 = "experts.fc1.weight"  # "ort": [E, 2I, hidden], rows interleaved gate_0, up_0, gate_1, up_1, ...
ORT_FC2 = "experts.fc2.weight"  # "ort": [E, hidden, I]

# com.microsoft.MoE's SwiGLU is  min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + beta)
# over interleaved (g, u) pairs; alpha 1, beta 0 and no limit (FLT_MAX: finite, so no inf in the model) make it
# silu(g) * u. Set explicitly: GPT-OSS uses alpha 1.702, beta 1, limit 7, and defaults have moved between releases.
ORT_ATTRS: dict[str, Any] = {
    "activation_type": "swiglu",
    "swiglu_fusion": 1,  # fused fc1, interleaved: the only SwiGLU form the CPU kernel runs
    "activation_alpha": 1.0,
    "activation_beta": 0.0,
    "swiglu_limit": float(np.finfo(np.float32).max),
    "use_sparse_mixer": 0,
}


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    experts_per_token: int
    intermediate_size: int  # per expert (Qwen3-MoE: config.moe_intermediate_size)
    norm_topk_prob: bool = True  # Mixtral: always; Qwen3-MoE: config.norm_topk_prob
    activation: str = "silu"

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token must be in [1, {self.num_experts}], got {self.experts_per_token}")
        if self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be positive, got {self.intermediate_size}")
        if self.activation != "silu":
            raise ValueError(f"only SwiGLU (silu) experts are supported, got {self.activation!r}")


def spec_from_hf_config(config: Any) -> MoESpec:
    """The MoE block of a transformers MixtralConfig, GraniteMoeConfig, Qwen3MoeConfig or Qwen2MoeConfig (its shared
    expert is the decoder's: ModelSpec.shared_expert_size)."""
    if config.model_type in ("mixtral", "granitemoe"):  # (Granite's softmax over the top k logits: the same weights)
        return MoESpec(int(config.num_local_experts), int(config.num_experts_per_tok), int(config.intermediate_size),
                       True, config.hidden_act)
    if config.model_type in ("qwen3_moe", "qwen2_moe"):
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       bool(config.norm_topk_prob), config.hidden_act)
    raise ValueError(f"no MoE block for model_type {config.model_type!r}")


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer `layer` has the MoE block (else a dense SwiGLU MLP of config.intermediate_size)."""
    if config.model_type in ("mixtral", "granitemoe"):
        return True
    return (layer not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


def canonical_from_hf(sd: Mapping[str, np.ndarray], hf_prefix: str, prefix: str) -> dict[str, np.ndarray]:
    """Canonical arrays from a transformers 5.x state dict (in memory, after its loading conversions).

    hf_prefix is the MoE module's, e.g. "model.layers.3.mlp." (both families): gate.weight [E, hidden],
    experts.gate_up_proj [E, 2I, hidden] (rows [0, I) gate, [I, 2I) up), experts.down_proj [E, hidden, I].
    """
    return {
        f"{prefix}.{ROUTER}": np.ascontiguousarray(sd[hf_prefix + "gate.weight"].T),
        f"{prefix}.{GATE_UP}": np.ascontiguousarray(sd[hf_prefix + "experts.gate_up_proj"].transpose(0, 2, 1)),
        f"{prefix}.{DOWN}": np.ascontiguousarray(sd[hf_prefix + "experts.down_proj"].transpose(0, 2, 1)),
    }


def moe_weights(weights: Mapping[str, np.ndarray], prefix: str, lowering: str) -> dict[str, np.ndarray]:
    """The arrays `lowering` needs beyond the canonical ones, named under `prefix` (same dtype as given).

    Every lowering references the canonical router weight. "loop" and "dense" reference the two canonical expert
    arrays too and need nothing more; "standard" references instead each expert's own 2-D gate_up and down
    (EXPERT_GATE_UP / EXPERT_DOWN), "ort" the interleaved fc1 and the transposed fc2 (ORT_FC1 / ORT_FC2). The
    graph's `weights_used` names what to store: a writer storing only those stores the experts once.
    """
    _check_lowering(lowering)
    if lowering == "standard":
        gate_up, down = weights[f"{prefix}.{GATE_UP}"], weights[f"{prefix}.{DOWN}"]
        return {**{f"{prefix}.{EXPERT_GATE_UP.format(j=j)}": np.ascontiguousarray(w) for j, w in enumerate(gate_up)},
                **{f"{prefix}.{EXPERT_DOWN.format(j=j)}": np.ascontiguousarray(w) for j, w in enumerate(down)}}
    if lowering != "ort":
        return {}
    gate_up = weights[f"{prefix}.{GATE_UP}"]  # [E, hidden, 2I]
    e, hidden, two_i = gate_up.shape
    inter = two_i // 2
    pairs = np.stack([gate_up[:, :, :inter], gate_up[:, :, inter:]], axis=-1).reshape(e, hidden, two_i)
    return {
        f"{prefix}.{ORT_FC1}": np.ascontiguousarray(pairs.transpose(0, 2, 1)),
        f"{prefix}.{ORT_FC2}": np.ascontiguousarray(weights[f"{prefix}.{DOWN}"].transpose(0, 2, 1)),
    }


def moe_block(b: GraphBuilder, h: str, prefix: str, weights: Mapping[str, np.ndarray], spec: MoESpec,
              lowering: str, mm: MatMul | None = None) -> str:
    """The MoE MLP of h [B, S, hidden] (the graph's compute dtype); returns its output [B, S, hidden].

    `weights` holds the canonical arrays (only the router's shape is read); "standard" and "ort" reference the
    arrays `moe_weights` makes for them. `mm` ("standard"): how to multiply by an expert's named weight.
    """
    _check_lowering(lowering)
    hidden, e = weights[f"{prefix}.{ROUTER}"].shape
    if e != spec.num_experts:
        raise ValueError(f"{prefix}.{ROUTER} has {e} experts, the spec {spec.num_experts}")
    x = b.op("Reshape", h, b.ints(-1, hidden))  # [N, hidden]
    logits = b.op("MatMul", x, b.weight(f"{prefix}.{ROUTER}"))  # [N, E] in the compute dtype, as transformers
    if lowering == "ort":
        y = b.op("MoE", x, logits, b.weight(f"{prefix}.{ORT_FC1}"), "", b.weight(f"{prefix}.{ORT_FC2}"), domain=MS,
                 k=spec.experts_per_token, normalize_routing_weights=int(spec.norm_topk_prob), **ORT_ATTRS)
    else:
        dense = _routing_matrix(b, logits, spec)  # [N, E]: the expert's weight where selected, else 0
        y = (_unrolled(b, x, dense, prefix, spec, mm) if lowering == "standard"
             else {"loop": _loop, "dense": _dense}[lowering](b, x, dense, prefix, spec))
    return b.op("Reshape", y, b.op("Shape", h))


def _check_lowering(lowering: str) -> None:
    if lowering not in LOWERINGS:
        raise ValueError(f"MoE lowering must be one of {LOWERINGS}, got {lowering!r}")


def _routing_matrix(b: GraphBuilder, logits: str, spec: MoESpec) -> str:
    """Softmax in fp32, top-k, renormalized if asked; scattered into a zero [N, E] matrix (compute dtype)."""
    probs = b.op("Softmax", b.to_float32(logits), axis=-1)
    top, idx = b.op_n("TopK", probs, b.ints(spec.experts_per_token), outputs=2, axis=-1, largest=1, sorted=1)
    if spec.norm_topk_prob:
        top = b.op("Div", top, b.op("ReduceSum", top, b.ints(-1), keepdims=1))
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    zeros = b.op("ConstantOfShape", b.op("Shape", probs), value=zero)
    return b.to_compute(b.op("ScatterElements", zeros, idx, top, axis=1))


MatMul = Callable[[str, str], str]  # (x, a weight's name without ".weight") -> x @ that weight


def _swiglu_expert(b: GraphBuilder, x: str, gate_up: str, down: str, inter: int, mm: MatMul | None = None) -> str:
    """down(silu(gate) * up); `mm` multiplies by a named expert weight (a quantized one, in an engine), else
    gate_up and down are tensors."""
    def times(y: str, w: str) -> str:
        return mm(y, w) if mm is not None else b.op("MatMul", y, w)

    gate, up = b.split(times(x, gate_up), [inter, inter])
    return times(b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up), down)


def _dense(b: GraphBuilder, x: str, dense: str, prefix: str, spec: MoESpec) -> str:
    """Every expert on every token: [N, hidden] @ [E, hidden, 2I] -> [E, N, 2I] ... -> [E, N, hidden], weighted."""
    y = _swiglu_expert(b, x, b.weight(f"{prefix}.{GATE_UP}"), b.weight(f"{prefix}.{DOWN}"), spec.intermediate_size)
    w = b.unsqueeze(b.op("Transpose", dense, perm=[1, 0]), 2)  # [E, N, 1]
    return b.op("ReduceSum", b.op("Mul", y, w), b.ints(0), keepdims=0)


def _add_expert(b: GraphBuilder, acc: str, x: str, rows: str, weight: str, gate_up: str, down: str,
                inter: int, mm: MatMul | None = None) -> str:
    """acc [N, hidden] plus the expert's weighted output on its tokens: rows [1, n] (NonZero's), weight [N]."""
    tokens = b.op("Squeeze", rows, b.ints(0))  # [n]
    ye = _swiglu_expert(b, b.op("Gather", x, tokens, axis=0), gate_up, down, inter, mm)  # [n, hidden]
    we = b.unsqueeze(b.op("Gather", weight, tokens, axis=0), 1)  # [n, 1]
    # each token once per expert, so a plain ScatterND of (gathered + new) adds in place (no "add" reduction: ONNX
    # Runtime's CPU ScatterND has none for fp16), rounding as transformers' index_add_ does
    at = b.op("Transpose", rows, perm=[1, 0])  # [n, 1]
    return b.op("ScatterND", acc, at, b.op("Add", b.op("GatherND", acc, at), b.op("Mul", ye, we)))


def _zeros_like(b: GraphBuilder, x: str) -> str:
    zero = helper.make_tensor("zero", b.onnx_dtype, [1], np.zeros(1, NP_DTYPES[b.dtype]))
    return b.op("ConstantOfShape", b.op("Shape", x), value=zero)


def _unrolled(b: GraphBuilder, x: str, dense: str, prefix: str, spec: MoESpec, mm: MatMul | None = None) -> str:
    """Each expert on its own tokens (NonZero of its routing column: empty when unpicked), its own 2-D weights
    (through `mm` when given: an engine's quantized ones)."""
    acc = _zeros_like(b, x)
    e = spec.num_experts
    columns = b.split(b.op("Transpose", dense, perm=[1, 0]), [1] * e, axis=0)  # E x [1, N]
    for j, column in enumerate(columns):
        weight = b.op("Squeeze", column, b.ints(0))  # [N]
        rows = b.op("NonZero", weight)  # [1, n]: the tokens that picked expert j (weight > 0)
        gate_up = f"{prefix}.{EXPERT_GATE_UP.format(j=j)}".removesuffix(".weight")
        down = f"{prefix}.{EXPERT_DOWN.format(j=j)}".removesuffix(".weight")
        if mm is None:
            gate_up, down = b.weight(gate_up + ".weight"), b.weight(down + ".weight")
        acc = _add_expert(b, acc, x, rows, weight, gate_up, down, spec.intermediate_size, mm)
    return acc


def _loop(b: GraphBuilder, x: str, dense: str, prefix: str, spec: MoESpec) -> str:
    """Loop over the experts some token picked (ascending); each runs on its own tokens only."""
    # "weight > 0" as the selection: an expert picked with weight exactly 0 would add nothing
    hit = b.op("NonZero", b.op("ReduceSum", dense, b.ints(0), keepdims=0))  # [1, U]
    experts = b.op("Squeeze", hit, b.ints(0))  # [U] expert ids, ascending
    trips = b.op("Squeeze", b.op("Shape", experts), b.ints(0))  # scalar int64
    acc0 = _zeros_like(b, x)

    outer, b.nodes = b.nodes, []
    it, cond, acc = f"{prefix}.moe_iter", f"{prefix}.moe_cond", f"{prefix}.moe_acc"
    expert = b.op("Gather", experts, it, axis=0)  # scalar
    weight = b.op("Gather", dense, expert, axis=1)  # [N]
    gate_up = b.op("Gather", b.weight(f"{prefix}.{GATE_UP}"), expert, axis=0)  # a copy: ONNX has no views
    down = b.op("Gather", b.weight(f"{prefix}.{DOWN}"), expert, axis=0)
    acc_out = _add_expert(b, acc, x, b.op("NonZero", weight), weight, gate_up, down, spec.intermediate_size)
    cond_out = b.op("Identity", cond)
    body_nodes, b.nodes = b.nodes, outer

    vi = helper.make_tensor_value_info
    body = helper.make_graph(
        body_nodes, f"{prefix}.moe_loop",
        [vi(it, TensorProto.INT64, []), vi(cond, TensorProto.BOOL, []), vi(acc, b.onnx_dtype, None)],
        [vi(cond_out, TensorProto.BOOL, []), vi(acc_out, b.onnx_dtype, None)])
    return b.op("Loop", trips, "", acc0, body=body)


def moe_spec(m: ModelSpec) -> MoESpec:
    return MoESpec(m.num_experts, m.experts_per_token, m.moe_intermediate_size, m.norm_topk_prob, m.activation)


def moe_mlp(c: Ctx, layer: int, h: str) -> str:
    """Layer `layer`'s mixture of experts in the graph's lowering (GraphOptions.moe); each expert's weights are
    linear layers (quantized ones too) in the "standard" lowering."""
    def mm(x: str, name: str) -> str:
        return linear(c, x, name)

    return moe_block(c.b, h, f"layers.{layer}", c.ckpt.weights, moe_spec(c.m), c.opts.moe, mm)


def with_moe_weights(ckpt: Checkpoint, lowering: str) -> Checkpoint:
    """The checkpoint with the arrays `lowering` needs added for each mixture layer (the canonical ones stay: a
    graph stores only the weights it uses); layers that have them already (quantized, say) are left as they are."""
    m = ckpt.spec
    extra: dict[str, np.ndarray] = {}
    for i in range(m.num_layers):
        prefix = f"layers.{i}"
        if m.is_moe(i) and not any(k.startswith(f"{prefix}.experts.0.") or k.startswith(f"{prefix}.{ORT_FC1}")
                                   for k in ckpt.weights):
            extra.update(moe_weights(ckpt.weights, prefix, lowering))
    return Checkpoint(m, {**ckpt.weights, **extra}) if extra else ckpt
