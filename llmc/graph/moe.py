"""The mixture-of-experts MLP block (transformers' Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, GLM-4.5, dots1 and
DeepSeek-V2 / V3) as ONNX, in four lowerings.

Routing (MoESpec.routing), the [N, E] routing weights, one of:
  "softmax"  (Mixtral, Qwen, GPT-OSS) logits = h @ W_router (+ b_router: GPT-OSS; in the compute dtype), softmax over
             all experts in fp32, top-k, then (Mixtral and GPT-OSS always, Qwen3-MoE when `norm_topk_prob`) the k
             weights divided by their sum (GPT-OSS's softmax over its top k logits: the same weights)
  "softmax_biased"  (ERNIE 4.5's) as "softmax", in fp32 (transformers keeps the router in fp32), but the experts are
             chosen by the top k of the probabilities + router.correction_bias; each picked expert's weight is its
             probability, divided by the k probabilities' sum
  "sigmoid"  (DeepSeek-V3's, as GLM-4.5 and dots1 have it) all in fp32, even in an fp16 graph (transformers keeps
             the router's weight and correction bias in fp32): scores = sigmoid(h @ W_router), the choice
             scores + router.correction_bias; the experts split into num_groups equal groups, each scored by the sum
             of its 2 best choices, and only the topk_groups best groups' experts compete: the top k of the choice
             there. Each picked expert's weight is its score (not its choice), divided by the k scores' sum
             (+ norm_eps, 1e-20 but LFM2-MoE's 1e-6) when `norm_topk_prob`, times routed_scaling.
  "sigmoid_logits"  (Kolibri-1's) in fp32: the experts are chosen by the top k of the logits + router.correction_bias,
             each picked expert's weight is sigmoid(its logit), divided by the k weights' sum when `norm_topk_prob`
  "sparsemixer"  (PhiMoE's, as transformers evaluates it) always 2 experts, in fp32: the first is the largest logit m1,
             its weight the softmax of the logits s with every s_e where (m1 - s_e) / max(|s_e|, m1) > 2 eps masked
             (eps: jitter_eps); the second the largest logit m2 of the others, its weight the softmax of those others
             masked the same way about m2; never renormalized
  "softmax_grouped"  (DeepSeek-V2's) softmax over all experts in fp32; with num_groups > topk_groups only the
             experts of the topk_groups groups with the largest single probability compete ("group_limited_greedy";
             else "greedy": all of them); the top k probabilities, divided by their sum when `norm_topk_prob`,
             times routed_scaling.
The shared experts of Qwen2-MoE, GLM-4.5 and dots1 are the decoder's (ModelSpec.shared_expert_size), not this block's.
Each selected expert is a gated MLP,
down(act(h @ gate (+ b), h @ up (+ b))) (+ b), and the block's output is the routing-weighted sum of its k experts'
outputs. MoESpec.activation names act:
  "silu"        silu(gate) * up (Mixtral, Qwen), no biases
  "swiglu_oss"  GPT-OSS's, with alpha and limit L:  g = min(gate, L),  (clamp(up, -L, L) + 1) * g * sigmoid(alpha g),
                and biases (MoESpec.bias) on the router and both expert products
  "relu2"       an ungated expert (Nemotron-H's): down(relu(h @ up)^2), its up weights [E, hidden, I] (UP) in place of
                gate_up; every lowering but "ort" (com.microsoft.MoE has no squared ReLU)

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
              only the selected experts; "sigmoid" and "softmax_biased" routing are computed before it, and given to it
              as log(w) (unpicked: a large negative) with no renormalization: its softmax makes that w / sum(w) over
              the k picked experts, and its output is multiplied by each token's sum(w), exactly the weighted sum).
              fc1 holds gate/up interleaved, [E, 2I, hidden] (row 2c gate column c, row 2c+1 up column c), fc2
              the down weights [E, hidden, I] (both from `moe_weights`), with biases the interleaved fc1 bias
              [E, 2I] and the canonical down bias; `ort_attrs` make its SwiGLU exactly the spec's activation.
              Quantized (`quantize_experts`, `--quant`): com.microsoft.QMoE with the same routing and attributes
              over fc1 / fc2 as 4- or 8-bit codes with a scale and an integer zero point a block (QMOE_PARTS).

Canonical weights (numpy, [in, out] like every llmc MatMul weight), under the block's prefix:
  router.weight [hidden, E], experts.gate_up.weight [E, hidden, 2I] (gate columns first), experts.down.weight
  [E, I, hidden]; when MoESpec.bias, also router.bias [E], experts.gate_up.bias [E, 2I] (gate first) and
  experts.down.bias [E, hidden]; for "sigmoid" / "softmax_biased" routing, router.correction_bias [E].
  `canonical_from_hf` maps a transformers 5.x state dict onto them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from llmc.errors import InputError
from llmc.graph.builder import GraphBuilder
from llmc.graph.checkpoint import Checkpoint
from llmc.graph.layers import Ctx, gelu_tanh, linear
from llmc.manifest import ModelSpec

MS = "com.microsoft"
LOWERINGS = ("standard", "loop", "dense", "ort")
ACTIVATIONS = ("silu", "swiglu_oss", "relu2", "gelu_tanh")  # (gelu_tanh: GeGLU experts, Gemma 4's)
ROUTINGS = ("softmax", "softmax_biased", "sigmoid", "softmax_grouped", "sigmoid_logits", "sparsemixer")
GROUPED = ("sigmoid", "softmax_grouped")  # the routings with expert groups and a routed scaling

ROUTER = "router.weight"  # [hidden, E]
GATE_UP = "experts.gate_up.weight"  # [E, hidden, 2I]: columns [0, I) gate, [I, 2I) up
DOWN = "experts.down.weight"  # [E, I, hidden]
UP = "experts.up.weight"  # [E, hidden, I]: an ungated expert's (MoESpec.gated False) in place of GATE_UP
ROUTER_BIAS = "router.bias"  # [E] (MoESpec.bias)
CORRECTION_BIAS = "router.correction_bias"  # [E] ("sigmoid", "softmax_biased": added to the scores to choose, fp32)
GATE_UP_BIAS = "experts.gate_up.bias"  # [E, 2I]: [0, I) gate, [I, 2I) up (MoESpec.bias)
DOWN_BIAS = "experts.down.bias"  # [E, hidden] (MoESpec.bias; "ort"'s fc2 bias as it is)
EXPERT_GATE_UP = "experts.{j}.gate_up.weight"  # "standard": expert j's [hidden, 2I]
EXPERT_DOWN = "experts.{j}.down.weight"  # "standard": expert j's [I, hidden]
EXPERT_UP = "experts.{j}.up.weight"  # "standard": an ungated expert j's [hidden, I]
EXPERT_GATE_UP_BIAS = "experts.{j}.gate_up.bias"  # "standard": expert j's [2I] (MoESpec.bias)
EXPERT_DOWN_BIAS = "experts.{j}.down.bias"  # "standard": expert j's [hidden] (MoESpec.bias)
ORT_FC1 = "experts.fc1.weight"  # "ort": [E, 2I, hidden], rows interleaved gate_0, up_0, gate_1, up_1, ...
ORT_FC2 = "experts.fc2.weight"  # "ort": [E, hidden, I]
ORT_FC1_BIAS = "experts.fc1.bias"  # "ort": [E, 2I], interleaved as fc1's rows (MoESpec.bias)
# "ort" with quantized experts (com.microsoft.QMoE, `quantize_experts`): each of fc1 / fc2 as rows [E, N, K] of
# `bits`-bit codes with a scale and an integer zero point a block along K
QMOE_PARTS = (".qweight", ".scales", ".zero_points")  # [E, N, K * bits / 8] uint8, [E, N, K / block], [E, N, ..] uint8

# com.microsoft.MoE's SwiGLU is  min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + beta)
# over interleaved (g, u) pairs; alpha 1, beta 0 and no limit (FLT_MAX: finite, so no inf in the model) make it
# silu(g) * u ("silu"); GPT-OSS's alpha, beta 1 and its limit make it "swiglu_oss" (`ort_attrs`; checked against
# transformers: the gate is clamped from above only, as GPT-OSS's). Set explicitly: defaults have moved between
# releases.
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
    norm_topk_prob: bool = True  # Mixtral, GPT-OSS: always; Qwen3-MoE: config.norm_topk_prob
    activation: str = "silu"  # one of ACTIVATIONS (the module's docstring)
    alpha: float = 0.0  # "swiglu_oss": the sigmoid's slope (GPT-OSS: config.swiglu_alpha)
    limit: float = 0.0  # "swiglu_oss": the clamp of gate and up (GPT-OSS: config.swiglu_limit)
    bias: bool = False  # the router and both expert products add a bias (ROUTER_BIAS, GATE_UP_BIAS, DOWN_BIAS)
    routing: str = "softmax"  # one of ROUTINGS (the module's docstring)
    num_groups: int = 1  # GROUPED routings: the expert groups (GLM-4.5: config.n_group)
    topk_groups: int = 1  # GROUPED: how many of the best groups' experts compete (config.topk_group)
    routed_scaling: float = 1.0  # GROUPED: the routing weights' factor (config.routed_scaling_factor)
    router_fp32: bool = False  # "softmax": the router in fp32 whatever the model's dtype (Hunyuan); the others always
    jitter_eps: float = 0.0  # "sparsemixer": the masks' threshold (PhiMoE: config.router_jitter_noise)
    scale_inputs: bool = False  # each expert runs on its tokens times their routing weights, its output added as it
    # is (Llama 4); without biases, so that an unpicked expert (weight 0) adds nothing
    norm_eps: float = 1e-20  # "sigmoid" with norm_topk_prob: added to the k scores' sum (LFM2-MoE: 1e-6)

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token must be in [1, {self.num_experts}], got {self.experts_per_token}")
        if self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be positive, got {self.intermediate_size}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoE experts' activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.activation == "swiglu_oss":
            for name, value in (("alpha", self.alpha), ("limit", self.limit)):
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"swiglu_oss experts need a finite positive {name}, got {value!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoE routing must be one of {ROUTINGS}, got {self.routing!r}")
        if not self.gated and self.bias:
            raise ValueError("ungated experts are built without biases")
        if self.scale_inputs and self.bias:
            raise ValueError("experts on scaled inputs have no biases (an unpicked one must add nothing)")
        if self.routing == "sparsemixer" and (self.experts_per_token != 2 or self.norm_topk_prob
                                              or not (math.isfinite(self.jitter_eps) and self.jitter_eps >= 0)):
            raise ValueError(f"sparsemixer routing picks 2 experts, unrenormalized, with a finite jitter_eps >= 0; got "
                             f"{self.experts_per_token}, norm_topk_prob {self.norm_topk_prob}, {self.jitter_eps!r}")
        if self.routing not in GROUPED:
            if (self.num_groups, self.topk_groups, self.routed_scaling) != (1, 1, 1.0):
                raise ValueError(f"num_groups, topk_groups and routed_scaling are {' and '.join(GROUPED)} routing's; "
                                 f"{self.routing} routing needs 1, 1, 1.0, got {self.num_groups}, {self.topk_groups}, "
                                 f"{self.routed_scaling!r}")
            return
        if self.num_groups <= 0 or self.num_experts % self.num_groups:
            raise ValueError(f"num_groups must divide num_experts {self.num_experts}, got {self.num_groups}")
        if self.routing == "sigmoid" and self.num_experts // self.num_groups < 2:  # (a group's score: its 2 best)
            raise ValueError(f"num_groups must leave at least 2 experts a group, got {self.num_groups} groups of "
                             f"{self.num_experts} experts")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups must be in [1, {self.num_groups}], got {self.topk_groups}")
        if self.experts_per_token > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(f"experts_per_token must be at most the {self.topk_groups} kept groups' "
                             f"{self.topk_groups * (self.num_experts // self.num_groups)} experts, got "
                             f"{self.experts_per_token}")
        if not (math.isfinite(self.routed_scaling) and self.routed_scaling > 0):
            raise ValueError(f"routed_scaling must be finite and positive, got {self.routed_scaling!r}")

    def float32_arrays(self) -> tuple[str, ...]:
        """The canonical router arrays (names under the block's prefix) transformers keeps in fp32 and an fp16
        export should too (every routing but "softmax"); the graph casts them to fp32 whichever dtype they are
        stored in."""
        if not self.fp32_router:
            return ()
        correction = (CORRECTION_BIAS,) if self.routing in ("softmax_biased", "sigmoid", "sigmoid_logits") else ()
        return (ROUTER, *correction, *((ROUTER_BIAS,) if self.bias else ()))

    @property
    def gated(self) -> bool:
        """The experts are gated MLPs (GATE_UP), not down(act(x @ up)) (UP: "relu2")."""
        return self.activation != "relu2"

    @property
    def fp32_router(self) -> bool:
        """The router's product in fp32 (transformers keeps its weight so): every routing but plain "softmax"."""
        return self.routing != "softmax" or self.router_fp32


# "sigmoid" routing's types (GLM-4.5's config names)
SIGMOID_ROUTED = ("glm4_moe", "dots1", "deepseek_v3", "glm4_moe_lite", "solar_open", "param2moe", "sarvam_moe",
                  "sarvam_mla", "minicpm5_moe", "deepseek_v32", "glm_moe_dsa", "axk1", "mimo_v2_flash")
FIRST_DENSE = (*SIGMOID_ROUTED, "deepseek_v2")  # their first config.first_k_dense_replace layers are dense MLPs
MLP_LAYER_TYPES = ("exaone_moe", "mellum", "minicpm5_moe", "hy_v3", "cohere2_moe", "deepseek_v32", "glm_moe_dsa",
                   "axk1", "mimo_v2_flash", "laguna", "kimi_linear")  # config.mlp_layer_types: "dense" / "sparse"


def spec_from_hf_config(config: Any) -> MoESpec:
    """The MoE block of a transformers MixtralConfig, GraniteMoeConfig, Qwen3MoeConfig, Qwen2MoeConfig, GptOssConfig,
    Glm4MoeConfig, Dots1Config or OlmoeConfig (Qwen2-MoE's, GLM-4.5's and dots1's shared experts are the decoder's:
    ModelSpec.shared_expert_size)."""
    # (Granite's softmax over the top k logits: the same weights)
    if config.model_type in ("mixtral", "granitemoe", "granitemoeshared", "granitemoe_swa", "granitemoehybrid"):
        return MoESpec(int(config.num_local_experts), int(config.num_experts_per_tok), int(config.intermediate_size),
                       True, config.hidden_act)
    if config.model_type == "ernie4_5_moe":
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       True, config.hidden_act, routing="softmax_biased")
    if config.model_type == "hunyuan_v1_moe":  # (one count for every layer: arch.py refuses per-layer lists)
        return MoESpec(int(config.num_experts), int(config.moe_topk), int(config.intermediate_size), True,
                       config.hidden_act, router_fp32=True)
    if config.model_type in ("olmoe", "flex_olmo"):  # (its experts are intermediate_size wide)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.intermediate_size),
                       bool(config.norm_topk_prob), config.hidden_act)
    if config.model_type == "lara_mini":  # (its router in fp32; its shared expert ungated: arch.py)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       bool(config.norm_topk_prob), config.hidden_act, router_fp32=True)
    if config.model_type == "qwen3_5_moe_text":  # (Qwen2-MoE's block, always renormalized)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       True, config.hidden_act)
    if config.model_type in ("qwen3_moe", "qwen2_moe", "mellum", "qwen3_next"):
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       bool(config.norm_topk_prob), config.hidden_act)
    if config.model_type == "gpt_oss":  # (its softmax over the top k logits: the renormalized weights)
        return MoESpec(int(config.num_local_experts), int(config.num_experts_per_tok), int(config.intermediate_size),
                       True, "swiglu_oss", float(config.swiglu_alpha), float(config.swiglu_limit), bias=True)
    if config.model_type == "afmoe":  # (its router always renormalizes)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       True, config.hidden_act, routing="sigmoid", routed_scaling=float(config.route_scale))
    if config.model_type == "exaone_moe":  # (GLM-4.5's router, its experts counted as num_experts)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       bool(config.norm_topk_prob), config.hidden_act, routing="sigmoid",
                       num_groups=int(config.n_group), topk_groups=int(config.topk_group),
                       routed_scaling=float(config.routed_scaling_factor))
    if config.model_type == "jamba":  # (a softmax over every expert, the top k's weights as they are)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.intermediate_size), False,
                       config.hidden_act)
    if config.model_type == "nemotron_h":  # (DeepSeek-V3's router; ungated squared-ReLU experts)
        return MoESpec(int(config.n_routed_experts), int(config.num_experts_per_tok),
                       int(config.moe_intermediate_size), bool(config.norm_topk_prob), "relu2", routing="sigmoid",
                       num_groups=int(config.n_group), topk_groups=int(config.topk_group),
                       routed_scaling=float(config.routed_scaling_factor))
    if config.model_type == "kimi_linear":  # (DeepSeek-V3's router, its experts counted as num_local_experts)
        return MoESpec(int(config.num_local_experts), int(config.num_experts_per_tok),
                       int(config.moe_intermediate_size), bool(config.norm_topk_prob), config.hidden_act,
                       routing="sigmoid", num_groups=int(config.n_group), topk_groups=int(config.topk_group),
                       routed_scaling=float(config.routed_scaling_factor))
    if config.model_type == "hy_v3":  # (MiniMax-M2's router, renormalized, times router_scaling_factor)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       True, config.hidden_act, routing="sigmoid", routed_scaling=float(config.router_scaling_factor))
    if config.model_type == "laguna":  # (one group, renormalized, times moe_routed_scaling_factor)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       True, config.hidden_act, routing="sigmoid",
                       routed_scaling=float(config.moe_routed_scaling_factor))
    if config.model_type == "lfm2_moe":  # (one group; use_expert_bias False: arch.py's zero correction bias)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       bool(config.norm_topk_prob), "silu", routing="sigmoid",
                       routed_scaling=float(config.routed_scaling_factor), norm_eps=1e-6)
    if config.model_type == "flint":  # (sigmoid scores choose with no correction bias: arch.py's zeros)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       bool(config.norm_topk_prob), config.hidden_act, routing="sigmoid")
    if config.model_type == "dbrx":  # (the top k weights over their p-norm: p = 1 renormalizes; arch.py refuses p > 1)
        ffn = config.ffn_config
        return MoESpec(int(ffn.moe_num_experts), int(ffn.moe_top_k), int(ffn.ffn_hidden_size),
                       ffn.moe_normalize_expert_weights == 1, ffn.ffn_act_fn.get("name", "silu"))
    if config.model_type == "llama4_text":  # (the top k logits' sigmoids, on the experts' inputs)
        return MoESpec(int(config.num_local_experts), int(config.num_experts_per_tok), int(config.intermediate_size),
                       False, config.hidden_act, routing="sigmoid_logits", scale_inputs=True)
    if config.model_type == "phimoe":  # (transformers' sparsemixer picks 2 whatever num_experts_per_tok says)
        return MoESpec(int(config.num_local_experts), 2, int(config.intermediate_size), False, config.hidden_act,
                       routing="sparsemixer", jitter_eps=float(config.router_jitter_noise))
    if config.model_type == "cohere2_moe":  # (the top k logits' softmax: renormalized; or their sigmoids)
        sigmoid = config.expert_selection_fn == "sigmoid"
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.intermediate_size),
                       bool(config.norm_topk_prob) if sigmoid else True, config.hidden_act,
                       routing="sigmoid" if sigmoid else "softmax")
    if config.model_type in ("kolibri1", "kolibri1_1"):  # (the choice on the logits + bias, the weights their
        # sigmoids)
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       bool(config.norm_topk_prob), config.hidden_act, routing="sigmoid_logits")
    if config.model_type == "minimax_m2":  # (DeepSeek-V3's scores and correction bias without groups, renormalized)
        return MoESpec(int(config.num_local_experts), int(config.num_experts_per_tok), int(config.intermediate_size),
                       True, config.hidden_act, routing="sigmoid")
    if config.model_type == "deepseek_v2":  # (its router never renormalizes)
        grouped = config.topk_method == "group_limited_greedy"
        if config.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {config.topk_method!r}: greedy or group_limited_greedy")
        return MoESpec(int(config.n_routed_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       False, config.hidden_act, routing="softmax_grouped",
                       num_groups=int(config.n_group) if grouped else 1,
                       topk_groups=int(config.topk_group) if grouped else 1,
                       routed_scaling=float(config.routed_scaling_factor))
    if config.model_type == "jetmoe":  # (softmax over the top k logits; its bias after the mixture: biased experts)
        return MoESpec(int(config.num_local_experts), int(config.num_experts_per_tok), int(config.intermediate_size),
                       True, config.activation_function, bias=True)
    if config.model_type == "gemma4_text":  # (softmax over every expert, the top k renormalized; GeGLU experts)
        return MoESpec(int(config.num_experts), int(config.top_k_experts), int(config.moe_intermediate_size), True,
                       "gelu_tanh")
    if config.model_type in SIGMOID_ROUTED:  # (dots1's, DeepSeek-V3's, GLM-4.7-Flash's router is GLM-4.5's)
        return MoESpec(int(config.n_routed_experts), int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                       bool(config.norm_topk_prob), config.hidden_act, routing="sigmoid",
                       num_groups=int(config.n_group), topk_groups=int(config.topk_group),
                       routed_scaling=float(config.routed_scaling_factor))
    raise ValueError(f"no MoE block for model_type {config.model_type!r}")


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer `layer` has the MoE block (else a dense SwiGLU MLP of config.intermediate_size)."""
    if config.model_type in ("mixtral", "granitemoe", "granitemoeshared", "gpt_oss", "olmoe", "hunyuan_v1_moe",
                             "minimax_m2", "flex_olmo", "granitemoe_swa", "kolibri1", "dbrx", "phimoe",
                             "qwen3_5_moe_text", "lara_mini", "jetmoe"):
        return True
    if config.model_type == "gemma4_text":  # (beside every layer's MLP)
        return bool(config.enable_moe_block)
    if config.model_type == "kolibri1_1":  # (a dense MLP in its mlp_only_layers)
        return layer not in config.mlp_only_layers
    if config.model_type == "nemotron_h":  # (its mixture blocks)
        return config.layers_block_type[layer] == "moe"
    if config.model_type == "jamba":  # (every expert_layer_period-th layer from expert_layer_offset)
        return int(config.layers_num_experts[layer]) > 1
    if config.model_type == "granitemoehybrid":  # (0 experts: its shared MLP alone, the dense one)
        return int(config.num_local_experts) > 0
    if config.model_type == "llama4_text":
        return layer in config.moe_layers
    if config.model_type in MLP_LAYER_TYPES:
        return config.mlp_layer_types[layer] == "sparse"
    if config.model_type in ("afmoe", "lfm2_moe"):
        return layer >= int(config.num_dense_layers)
    if config.model_type in FIRST_DENSE:  # the first first_k_dense_replace layers are dense
        return layer >= int(getattr(config, "first_k_dense_replace", 0) or 0)  # (Solar Open: none)
    if config.model_type == "ernie4_5_moe":  # every moe_layer_interval-th layer from start to end index
        return ((layer + 1) % int(config.moe_layer_interval) == 0
                and int(config.moe_layer_start_index) <= layer <= int(config.moe_layer_end_index))
    return (layer not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


def canonical_from_hf(sd: Mapping[str, np.ndarray], hf_prefix: str, prefix: str) -> dict[str, np.ndarray]:
    """Canonical arrays from a transformers 5.x state dict (in memory, after its loading conversions).

    hf_prefix is the MoE module's, e.g. "model.layers.3.mlp." (every family). Mixtral / Qwen / GLM-4.5 / dots1:
    gate.weight [E, hidden], experts.gate_up_proj [E, 2I, hidden] (rows [0, I) gate, [I, 2I) up), experts.down_proj
    [E, hidden, I], and GLM-4.5's / dots1's gate.e_score_correction_bias [E] (ERNIE 4.5's
    gate.moe_statics.e_score_correction_bias [1, E]). GPT-OSS (told by its router.weight):
    router.weight [E, hidden], router.bias [E], experts.gate_up_proj [E, hidden, 2I] (columns interleaved gate_0,
    up_0, gate_1, ...), gate_up_proj_bias [E, 2I] (the same), experts.down_proj [E, I, hidden], down_proj_bias
    [E, hidden].
    """
    p, e = hf_prefix, hf_prefix + "experts."
    if e + "up_proj" in sd:  # (Nemotron-H's ungated experts: up_proj [E, I, hidden], down_proj [E, hidden, I])
        return {f"{prefix}.{ROUTER}": np.ascontiguousarray(sd[p + "gate.weight"].T),
                f"{prefix}.{CORRECTION_BIAS}": np.ascontiguousarray(sd[p + "gate.e_score_correction_bias"].reshape(-1)),
                f"{prefix}.{UP}": np.ascontiguousarray(sd[e + "up_proj"].transpose(0, 2, 1)),
                f"{prefix}.{DOWN}": np.ascontiguousarray(sd[e + "down_proj"].transpose(0, 2, 1))}
    if p + "router.weight" not in sd:
        # GLM-4.5's / dots1's [E], ERNIE 4.5's [1, E] (under its moe_statics)
        correction = next((sd[n] for n in (p + "gate.e_score_correction_bias",
                                           p + "gate.moe_statics.e_score_correction_bias") if n in sd), None)
        return {
            f"{prefix}.{ROUTER}": np.ascontiguousarray(sd[p + "gate.weight"].T),
            **({f"{prefix}.{CORRECTION_BIAS}": np.ascontiguousarray(correction.reshape(-1))}
               if correction is not None else {}),
            f"{prefix}.{GATE_UP}": np.ascontiguousarray(sd[e + "gate_up_proj"].transpose(0, 2, 1)),
            f"{prefix}.{DOWN}": np.ascontiguousarray(sd[e + "down_proj"].transpose(0, 2, 1)),
        }
    return {
        f"{prefix}.{ROUTER}": np.ascontiguousarray(sd[p + "router.weight"].T),
        f"{prefix}.{ROUTER_BIAS}": np.ascontiguousarray(sd[p + "router.bias"]),
        f"{prefix}.{GATE_UP}": _halves(sd[e + "gate_up_proj"]),
        f"{prefix}.{GATE_UP_BIAS}": _halves(sd[e + "gate_up_proj_bias"]),
        f"{prefix}.{DOWN}": np.ascontiguousarray(sd[e + "down_proj"]),
        f"{prefix}.{DOWN_BIAS}": np.ascontiguousarray(sd[e + "down_proj_bias"]),
    }


def _halves(a: np.ndarray) -> np.ndarray:
    """Interleaved gate/up (last axis gate_0, up_0, gate_1, up_1, ...) as gate columns first, then up's."""
    return np.ascontiguousarray(np.concatenate([a[..., 0::2], a[..., 1::2]], axis=-1))


def _interleaved(a: np.ndarray) -> np.ndarray:
    """Gate-first columns (last axis [0, I) gate, [I, 2I) up) interleaved: gate_0, up_0, gate_1, up_1, ..."""
    inter = a.shape[-1] // 2
    return np.stack([a[..., :inter], a[..., inter:]], axis=-1).reshape(a.shape)


def moe_weights(weights: Mapping[str, np.ndarray], prefix: str, lowering: str) -> dict[str, np.ndarray]:
    """The arrays `lowering` needs beyond the canonical ones, named under `prefix` (same dtype as given).

    Every lowering references the canonical router weight (and bias). "loop" and "dense" reference the canonical
    expert arrays too and need nothing more; "standard" references instead each expert's own 2-D gate_up and down
    (EXPERT_GATE_UP / EXPERT_DOWN) and, where the canonical biases exist, its 1-D biases (EXPERT_GATE_UP_BIAS /
    EXPERT_DOWN_BIAS), "ort" the interleaved fc1, the transposed fc2 (ORT_FC1 / ORT_FC2) and the interleaved fc1
    bias (ORT_FC1_BIAS; fc2's is DOWN_BIAS). The graph's `weights_used` names what to store: a writer storing only
    those stores the experts once.
    """
    _check_lowering(lowering)
    biased = f"{prefix}.{GATE_UP_BIAS}" in weights
    ungated = f"{prefix}.{UP}" in weights
    if lowering == "standard":
        per_expert = {EXPERT_UP: UP} if ungated else {EXPERT_GATE_UP: GATE_UP}
        per_expert.update({EXPERT_DOWN: DOWN,
                           **({EXPERT_GATE_UP_BIAS: GATE_UP_BIAS, EXPERT_DOWN_BIAS: DOWN_BIAS} if biased else {})})
        return {f"{prefix}.{ours.format(j=j)}": np.ascontiguousarray(w)
                for ours, stacked in per_expert.items() for j, w in enumerate(weights[f"{prefix}.{stacked}"])}
    if lowering != "ort":
        return {}
    if ungated:
        raise InputError(f"{prefix}: --moe ort builds com.microsoft.MoE, which has no squared ReLU for ungated "
                         "experts; use --moe standard")
    return {
        f"{prefix}.{ORT_FC1}": np.ascontiguousarray(_interleaved(weights[f"{prefix}.{GATE_UP}"]).transpose(0, 2, 1)),
        f"{prefix}.{ORT_FC2}": np.ascontiguousarray(weights[f"{prefix}.{DOWN}"].transpose(0, 2, 1)),
        **({f"{prefix}.{ORT_FC1_BIAS}": _interleaved(weights[f"{prefix}.{GATE_UP_BIAS}"])} if biased else {}),
    }


def ort_attrs(spec: MoESpec) -> dict[str, Any]:
    """com.microsoft.MoE's SwiGLU attributes for the spec's activation (ORT_ATTRS: silu)."""
    if spec.activation == "silu":
        return ORT_ATTRS
    if spec.activation == "gelu_tanh":
        raise InputError("--moe ort builds com.microsoft.MoE, which has no GeGLU experts (this model's: Gemma 4's); "
                         "use --moe standard or loop")
    return {**ORT_ATTRS, "activation_alpha": spec.alpha, "activation_beta": 1.0, "swiglu_limit": spec.limit}


def moe_block(b: GraphBuilder, h: str, prefix: str, weights: Mapping[str, np.ndarray], spec: MoESpec,
              lowering: str, mm: MatMul | None = None, accuracy_level: int = 0, experts_in: str | None = None) -> str:
    """The MoE MLP of h [B, S, hidden] (the graph's compute dtype); returns its output [B, S, hidden]. With
    `experts_in` [B, S, L] the router still reads h, but the experts run on experts_in and the output is theirs,
    [B, S, L] (Nemotron-H's latent experts; not "ort").

    `weights` holds the canonical arrays (only the router's shape is read); "standard" and "ort" reference the
    arrays `moe_weights` makes for them ("ort": QMoE where `quantize_experts` replaced them). `mm` ("standard"): how
    to multiply by an expert's named weight (adding its bias, "<name>.bias", when spec.bias). `accuracy_level`: QMoE's
    (MatMulNBits' meaning: 4 lets the 4-bit experts take int8 activations).
    """
    _check_lowering(lowering)
    if not spec.gated and lowering == "ort":
        raise InputError("--moe ort builds com.microsoft.MoE, which has no squared ReLU for ungated experts "
                         "(Nemotron-H's); use --moe standard")
    if spec.scale_inputs and lowering == "ort":
        raise ValueError("com.microsoft.MoE weights the experts' outputs; experts on scaled inputs (Llama 4) need the "
                         "standard, loop or dense lowering")
    hidden, e = weights[f"{prefix}.{ROUTER}"].shape
    if e != spec.num_experts:
        raise ValueError(f"{prefix}.{ROUTER} has {e} experts, the spec {spec.num_experts}")
    x = b.op("Reshape", h, b.ints(-1, hidden))  # [N, hidden]
    logits = _router_logits(b, x, prefix, spec)
    if experts_in is not None:
        if lowering == "ort":
            raise InputError("--moe ort builds com.microsoft.MoE, whose experts read the router's input; use --moe "
                             "standard")
        x = b.op("Reshape", experts_in, b.op("Concat", b.ints(-1), b.op("Shape", experts_in, start=-1), axis=0))
    if lowering == "ort":
        softmax = spec.routing == "softmax"
        router, total = ((b.to_compute(logits) if spec.fp32_router else logits, "") if softmax
                         else _ort_router(b, _routing_matrix(b, logits, prefix, spec)))
        attrs = {"k": spec.experts_per_token, "normalize_routing_weights": int(softmax and spec.norm_topk_prob),
                 **ort_attrs(spec)}
        if f"{prefix}.{ORT_FC1}{QMOE_PARTS[0]}" in weights:
            y = _qmoe(b, x, router, prefix, weights, spec, attrs, accuracy_level)
        else:
            fc1 = [b.weight(f"{prefix}.{ORT_FC1}"), b.weight(f"{prefix}.{ORT_FC1_BIAS}") if spec.bias else ""]
            fc2 = [b.weight(f"{prefix}.{ORT_FC2}"), *([b.weight(f"{prefix}.{DOWN_BIAS}")] if spec.bias else [])]
            y = b.op("MoE", x, router, *fc1, *fc2, domain=MS, **attrs)
        if total:
            y = b.op("Mul", y, total)
    else:
        dense = b.to_compute(_routing_matrix(b, logits, prefix, spec))  # [N, E]: picked experts' weights, else 0
        y = (_unrolled(b, x, dense, prefix, spec, mm) if lowering == "standard"
             else {"loop": _loop, "dense": _dense}[lowering](b, x, dense, prefix, spec))
    return b.op("Reshape", y, b.op("Shape", h if experts_in is None else experts_in))


def _qmoe(b: GraphBuilder, x: str, router: str, prefix: str, weights: Mapping[str, np.ndarray], spec: MoESpec,
          attrs: dict[str, Any], accuracy_level: int) -> str:
    """com.microsoft.QMoE over `quantize_experts`' arrays: MoE's routing and activation, the experts' products
    dequantized as (q - z) * s a block."""
    def part(fc: str, i: int) -> str:
        return b.weight(f"{prefix}.{fc}{QMOE_PARTS[i]}")

    q1 = weights[f"{prefix}.{ORT_FC1}{QMOE_PARTS[0]}"]  # [E, 2I, hidden * bits / 8]
    hidden = weights[f"{prefix}.{ROUTER}"].shape[0]
    bits = 8 * q1.shape[-1] // hidden
    block = hidden // weights[f"{prefix}.{ORT_FC1}{QMOE_PARTS[1]}"].shape[-1]
    bias1 = b.weight(f"{prefix}.{ORT_FC1_BIAS}") if spec.bias else ""
    bias2 = b.weight(f"{prefix}.{DOWN_BIAS}") if spec.bias else ""
    inputs = [x, router, part(ORT_FC1, 0), part(ORT_FC1, 1), bias1, part(ORT_FC2, 0), part(ORT_FC2, 1), bias2,
              "", "", "", part(ORT_FC1, 2), part(ORT_FC2, 2)]  # (no fc3: gate and up fused in fc1)
    return b.op("QMoE", *inputs, domain=MS, expert_weight_bits=bits, block_size=block, quant_type="int",
                weights_prepacked=0, accuracy_level=accuracy_level, **attrs)


def quantize_experts(weights: Mapping[str, np.ndarray], prefix: str, bits: int, block_size: int) -> dict[str, np.ndarray]:
    """The "ort" lowering's float fc1 / fc2 (`moe_weights`) of the block under `prefix` as QMoE's arrays
    (QMOE_PARTS, `quant.quantize_rows`), named after them; the float ones are then no longer needed."""
    from llmc.graph.quant import quantize_rows

    out = {}
    for fc in (ORT_FC1, ORT_FC2):
        k = weights[f"{prefix}.{fc}"].shape[-1]
        if k % block_size or block_size < 16 or block_size & (block_size - 1):  # (QMoE's blocks: 2^n >= 16)
            raise InputError(f"{prefix}.{fc}: --block-size {block_size} must be a power of 2 >= 16 dividing the "
                             f"experts' input size {k} (--moe ort quantizes them on ONNX Runtime's QMoE)")
        for suffix, array in zip(QMOE_PARTS, quantize_rows(weights[f"{prefix}.{fc}"], bits, block_size)):
            out[f"{prefix}.{fc}{suffix}"] = array
    return out


def _check_lowering(lowering: str) -> None:
    if lowering not in LOWERINGS:
        raise ValueError(f"MoE lowering must be one of {LOWERINGS}, got {lowering!r}")


def _router_logits(b: GraphBuilder, x: str, prefix: str, spec: MoESpec) -> str:
    """x @ W_router (+ b_router) [N, E]: in the compute dtype for "softmax" routing (as transformers), in fp32 for
    the others and an fp32 router (the router's arrays cast to fp32: a no-op where they are stored so,
    `MoESpec.float32_arrays`)."""
    fp32 = b.to_float32 if spec.fp32_router else (lambda t: t)
    logits = b.op("MatMul", fp32(x), fp32(b.weight(f"{prefix}.{ROUTER}")))
    if spec.bias:
        logits = b.op("Add", logits, fp32(b.weight(f"{prefix}.{ROUTER_BIAS}")))
    return logits


def _f32(b: GraphBuilder, value: float) -> str:
    return b.const(np.array(value, dtype=np.float32))


def _filled(b: GraphBuilder, shape: str, value: float) -> str:
    """An fp32 tensor of `shape` (a 1-D int64 tensor) filled with value."""
    return b.op("ConstantOfShape", shape, value=helper.make_tensor("value", TensorProto.FLOAT, [1], [value]))


def _routing_matrix(b: GraphBuilder, logits: str, prefix: str, spec: MoESpec) -> str:
    """The spec's routing (the module's docstring) in fp32: the k picked experts' weights scattered into a zero
    [N, E] matrix (fp32)."""
    k = b.ints(spec.experts_per_token)
    if spec.routing == "softmax":
        top, idx = b.op_n("TopK", b.op("Softmax", b.to_float32(logits), axis=-1), k, outputs=2, axis=-1)
    elif spec.routing == "softmax_biased":
        probs = b.op("Softmax", logits, axis=-1)
        choice = b.op("Add", probs, b.to_float32(b.weight(f"{prefix}.{CORRECTION_BIAS}")))
        idx = b.op_n("TopK", choice, k, outputs=2, axis=-1)[1]
        top = b.op("GatherElements", probs, idx, axis=1)  # the probabilities, not the choices
    elif spec.routing == "softmax_grouped":
        scores = b.op("Softmax", logits, axis=-1)
        choice = _in_best_groups(b, scores, spec) if spec.topk_groups < spec.num_groups else scores
        idx = b.op_n("TopK", choice, k, outputs=2, axis=-1)[1]
        top = b.op("GatherElements", scores, idx, axis=1)
    elif spec.routing == "sparsemixer":
        idx, top = _sparsemixer(b, logits, spec.jitter_eps)
    elif spec.routing == "sigmoid_logits":
        choice = b.op("Add", logits, b.to_float32(b.weight(f"{prefix}.{CORRECTION_BIAS}")))
        idx = b.op_n("TopK", choice, k, outputs=2, axis=-1)[1]
        top = b.op("GatherElements", b.op("Sigmoid", logits), idx, axis=1)
    else:
        scores = b.op("Sigmoid", logits)
        choice = b.op("Add", scores, b.to_float32(b.weight(f"{prefix}.{CORRECTION_BIAS}")))
        if spec.topk_groups < spec.num_groups:
            choice = _in_best_groups(b, choice, spec)
        idx = b.op_n("TopK", choice, k, outputs=2, axis=-1)[1]
        top = b.op("GatherElements", scores, idx, axis=1)  # the scores, not the choices
    if spec.norm_topk_prob:
        total = b.op("ReduceSum", top, b.ints(-1), keepdims=1)
        if spec.routing == "sigmoid":  # (transformers' guard against a zero sum: softmax's cannot be)
            total = b.op("Add", total, _f32(b, spec.norm_eps))
        top = b.op("Div", top, total)
    if spec.routed_scaling != 1.0:
        top = b.op("Mul", top, _f32(b, spec.routed_scaling))
    return b.op("ScatterElements", _filled(b, b.op("Shape", logits), 0.0), idx, top, axis=1)


def _sparsemixer(b: GraphBuilder, logits: str, eps: float) -> tuple[str, str]:
    """PhiMoE's two experts and their weights ([N, 2] each) from fp32 logits s [N, E] (the module's docstring)."""
    lowest = _f32(b, float(np.finfo(np.float32).min))  # (transformers: -inf; exp underflows to 0 either way)
    magnitude = b.op("Abs", logits)

    def pick(scores: str) -> tuple[str, str]:  # the largest of `scores` and its weight
        best, idx = b.op_n("TopK", scores, b.ints(1), outputs=2, axis=-1)  # [N, 1]
        far = b.op("Greater", b.op("Div", b.op("Sub", best, logits), b.op("Max", magnitude, best)), _f32(b, 2 * eps))
        weights = b.op("Softmax", b.op("Where", far, lowest, scores), axis=-1)
        return idx, b.op("GatherElements", weights, idx, axis=1)

    first, w1 = pick(logits)
    others = b.op("ScatterElements", logits, first, _filled(b, b.op("Shape", first), float(np.finfo(np.float32).min)),
                  axis=1)
    second, w2 = pick(others)
    return b.op("Concat", first, second, axis=1), b.op("Concat", w1, w2, axis=1)


def _in_best_groups(b: GraphBuilder, choice: str, spec: MoESpec) -> str:
    """choice [N, E] (fp32) with the experts outside each token's topk_groups best groups (a group's score: the sum
    of its 2 best choices, "sigmoid"; its best probability, "softmax_grouped") at the lowest float (transformers:
    -inf, or 0 under probabilities, which are positive: the same picks), so that no top k reaches them."""
    grouped = b.op("Reshape", choice, b.ints(-1, spec.num_groups, spec.num_experts // spec.num_groups))  # [N, G, E/G]
    if spec.routing == "sigmoid":
        best2 = b.op_n("TopK", grouped, b.ints(2), outputs=2, axis=-1)[0]
        group_scores = b.op("ReduceSum", best2, b.ints(-1), keepdims=0)  # [N, G]
    else:
        group_scores = b.reduce_max(grouped, -1, keepdims=0)
    kept = b.op_n("TopK", group_scores, b.ints(spec.topk_groups), outputs=2, axis=-1)[1]  # [N, topk_groups]
    mask = b.op("ScatterElements", _filled(b, b.op("Shape", group_scores), 0.0), kept,
                _filled(b, b.op("Shape", kept), 1.0), axis=1)  # [N, G]: 1 where kept
    keep = b.op("Cast", b.unsqueeze(mask, 2), to=TensorProto.BOOL)  # [N, G, 1]
    lowest = _f32(b, float(np.finfo(np.float32).min))
    return b.op("Reshape", b.op("Where", keep, grouped, lowest), b.op("Shape", choice))


def _ort_router(b: GraphBuilder, dense: str) -> tuple[str, str]:
    """com.microsoft.MoE's router input for routing weights computed before it, dense [N, E] (fp32): log(w / max w)
    where picked (relative to the largest: fine fp16 steps), else -1e4 (its softmax's exp underflows to exactly 0;
    finite, so a token with no positive weight gets 0, not NaN). Without renormalization its softmax and top k give
    w / sum(w) over the picked experts; returns that input and sum(w) [N, 1] to multiply its output by (both in
    the compute dtype)."""
    largest = b.reduce_max(dense, -1)
    logs = b.op("Log", b.op("Div", dense, largest))
    router = b.op("Where", b.op("Greater", dense, _f32(b, 0.0)), logs, _f32(b, -1e4))
    return b.to_compute(router), b.to_compute(b.op("ReduceSum", dense, b.ints(-1), keepdims=1))


MatMul = Callable[[str, str], str]  # (x, a weight's name without ".weight") -> x @ that weight (+ its bias)
NO_BIAS = ("", "")


def _activation(b: GraphBuilder, gate: str, up: str, spec: MoESpec) -> str:
    """The spec's gated activation of an expert's gate and up halves (the module's docstring), in transformers'
    order of operations."""
    if spec.activation == "silu":
        return b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up)
    if spec.activation == "gelu_tanh":  # GeGLU
        return b.op("Mul", gelu_tanh(b, gate), up)
    limit = b.scalar(spec.limit)
    g = b.op("Min", gate, limit)
    u = b.op("Clip", up, b.scalar(-spec.limit), limit)
    glu = b.op("Mul", g, b.op("Sigmoid", b.op("Mul", g, b.scalar(spec.alpha))))
    return b.op("Mul", b.op("Add", u, b.scalar(1.0)), glu)


def _expert(b: GraphBuilder, x: str, gate_up: str, down: str, spec: MoESpec, mm: MatMul | None = None,
            biases: tuple[str, str] = NO_BIAS) -> str:
    """down(act(x @ gate_up + its bias)) + down's bias; `mm` multiplies by a named expert weight and adds its bias
    (a quantized one, in an engine), else gate_up and down are tensors and `biases` theirs ("": none)."""
    def times(y: str, w: str, bias: str) -> str:
        y = mm(y, w) if mm is not None else b.op("MatMul", y, w)
        return b.op("Add", y, bias) if bias else y

    if not spec.gated:  # ("relu2": gate_up is the up weight) down(relu(x @ up)^2)
        inner = b.op("Relu", times(x, gate_up, biases[0]))
        return times(b.op("Mul", inner, inner), down, biases[1])
    inter = spec.intermediate_size
    gate, up = b.split(times(x, gate_up, biases[0]), [inter, inter])
    return times(_activation(b, gate, up, spec), down, biases[1])


def _dense(b: GraphBuilder, x: str, dense: str, prefix: str, spec: MoESpec) -> str:
    """Every expert on every token: [N, hidden] @ [E, hidden, 2I] -> [E, N, 2I] ... -> [E, N, hidden], weighted."""
    biases = ((b.unsqueeze(b.weight(f"{prefix}.{GATE_UP_BIAS}"), 1), b.unsqueeze(b.weight(f"{prefix}.{DOWN_BIAS}"), 1))
              if spec.bias else NO_BIAS)  # [E, 1, 2I], [E, 1, hidden]
    w = b.unsqueeze(b.op("Transpose", dense, perm=[1, 0]), 2)  # [E, N, 1]
    first = b.weight(f"{prefix}.{GATE_UP if spec.gated else UP}")
    if spec.scale_inputs:  # [E, N, hidden] inputs, the outputs summed as they are
        y = _expert(b, b.op("Mul", x, w), first, b.weight(f"{prefix}.{DOWN}"), spec)
        return b.op("ReduceSum", y, b.ints(0), keepdims=0)
    y = _expert(b, x, first, b.weight(f"{prefix}.{DOWN}"), spec, biases=biases)
    return b.op("ReduceSum", b.op("Mul", y, w), b.ints(0), keepdims=0)


def _add_expert(b: GraphBuilder, acc: str, x: str, rows: str, weight: str, gate_up: str, down: str, spec: MoESpec,
                mm: MatMul | None = None, biases: tuple[str, str] = NO_BIAS) -> str:
    """acc [N, hidden] plus the expert's weighted output on its tokens: rows [1, n] (NonZero's), weight [N]."""
    tokens = b.op("Squeeze", rows, b.ints(0))  # [n]
    xe = b.op("Gather", x, tokens, axis=0)
    we = b.unsqueeze(b.op("Gather", weight, tokens, axis=0), 1)  # [n, 1]
    if spec.scale_inputs:  # (Llama 4: the expert on its weighted input, its output as it is)
        xe, we = b.op("Mul", xe, we), ""
    ye = _expert(b, xe, gate_up, down, spec, mm, biases)  # [n, hidden]
    # each token once per expert, so a plain ScatterND of (gathered + new) adds in place (no "add" reduction: ONNX
    # Runtime's CPU ScatterND has none for fp16), rounding as transformers' index_add_ does
    at = b.op("Transpose", rows, perm=[1, 0])  # [n, 1]
    return b.op("ScatterND", acc, at, b.op("Add", b.op("GatherND", acc, at), b.op("Mul", ye, we) if we else ye))


def _unrolled(b: GraphBuilder, x: str, dense: str, prefix: str, spec: MoESpec, mm: MatMul | None = None) -> str:
    """Each expert on its own tokens (NonZero of its routing column: empty when unpicked), its own 2-D weights
    (through `mm` when given: an engine's quantized ones)."""
    acc = b.zeros(b.op("Shape", x))
    e = spec.num_experts
    columns = b.split(b.op("Transpose", dense, perm=[1, 0]), [1] * e, axis=0)  # E x [1, N]
    for j, column in enumerate(columns):
        weight = b.op("Squeeze", column, b.ints(0))  # [N]
        rows = b.op("NonZero", weight)  # [1, n]: the tokens that picked expert j (weight > 0)
        gate_up = f"{prefix}.{(EXPERT_GATE_UP if spec.gated else EXPERT_UP).format(j=j)}".removesuffix(".weight")
        down = f"{prefix}.{EXPERT_DOWN.format(j=j)}".removesuffix(".weight")
        biases = NO_BIAS  # `mm` adds them
        if mm is None:
            if spec.bias:
                biases = (b.weight(f"{prefix}.{EXPERT_GATE_UP_BIAS.format(j=j)}"),
                          b.weight(f"{prefix}.{EXPERT_DOWN_BIAS.format(j=j)}"))
            gate_up, down = b.weight(gate_up + ".weight"), b.weight(down + ".weight")
        acc = _add_expert(b, acc, x, rows, weight, gate_up, down, spec, mm, biases)
    return acc


def _loop(b: GraphBuilder, x: str, dense: str, prefix: str, spec: MoESpec) -> str:
    """Loop over the experts some token picked (ascending); each runs on its own tokens only."""
    # "weight > 0" as the selection: an expert picked with weight exactly 0 would add nothing
    hit = b.op("NonZero", b.op("ReduceSum", dense, b.ints(0), keepdims=0))  # [1, U]
    experts = b.op("Squeeze", hit, b.ints(0))  # [U] expert ids, ascending
    trips = b.op("Squeeze", b.op("Shape", experts), b.ints(0))  # scalar int64
    acc0 = b.zeros(b.op("Shape", x))

    outer, b.nodes = b.nodes, []
    it, cond, acc = f"{prefix}.moe_iter", f"{prefix}.moe_cond", f"{prefix}.moe_acc"
    expert = b.op("Gather", experts, it, axis=0)  # scalar

    def picked(name: str) -> str:  # the expert's slice of a stacked array: a copy (ONNX has no views)
        return b.op("Gather", b.weight(f"{prefix}.{name}"), expert, axis=0)

    weight = b.op("Gather", dense, expert, axis=1)  # [N]
    biases = (picked(GATE_UP_BIAS), picked(DOWN_BIAS)) if spec.bias else NO_BIAS
    acc_out = _add_expert(b, acc, x, b.op("NonZero", weight), weight, picked(GATE_UP if spec.gated else UP),
                          picked(DOWN), spec, biases=biases)
    cond_out = b.op("Identity", cond)
    body_nodes, b.nodes = b.nodes, outer

    vi = helper.make_tensor_value_info
    body = helper.make_graph(
        body_nodes, f"{prefix}.moe_loop",
        [vi(it, TensorProto.INT64, []), vi(cond, TensorProto.BOOL, []), vi(acc, b.onnx_dtype, None)],
        [vi(cond_out, TensorProto.BOOL, []), vi(acc_out, b.onnx_dtype, None)])
    return b.op("Loop", trips, "", acc0, body=body)


def moe_spec(m: ModelSpec) -> MoESpec:
    return MoESpec(m.num_experts, m.experts_per_token, m.moe_intermediate_size, m.norm_topk_prob, m.moe_activation,
                   m.swiglu_alpha, m.swiglu_limit, m.moe_bias, m.moe_routing, m.moe_groups, m.moe_topk_groups,
                   m.routed_scaling, m.moe_router_fp32, m.moe_jitter_eps, m.moe_scale_inputs, m.moe_norm_eps)


def moe_mlp(c: Ctx, layer: int, h: str, experts_in: str | None = None) -> str:
    """Layer `layer`'s mixture of experts in the graph's lowering (GraphOptions.moe); each expert's weights are
    linear layers (quantized ones too) in the "standard" lowering. With ModelSpec.moe_latent_size the experts run on
    h @ moe_latent_in and their sum goes back through moe_latent_out (Nemotron-H's latent experts); `experts_in`: the
    experts' input where it is not the router's (Gemma 4's, each its own norm of the block's input)."""
    def mm(x: str, name: str) -> str:
        return linear(c, x, name)

    accuracy = c.opts.quant.accuracy_level if c.opts.quant is not None else 0
    p = f"layers.{layer}"
    latent = linear(c, h, f"{p}.moe_latent_in") if c.m.moe_latent_size else None
    y = moe_block(c.b, h, p, c.ckpt.weights, moe_spec(c.m), c.opts.moe, mm, accuracy, latent or experts_in)
    return linear(c, y, f"{p}.moe_latent_out") if latent is not None else y


def float32_weights(m: ModelSpec) -> frozenset[str]:
    """The checkpoint names of every mixture layer's router arrays an fp16 export keeps in fp32 (as transformers
    does: MoESpec.float32_arrays)."""
    if not m.num_experts:
        return frozenset()
    arrays = moe_spec(m).float32_arrays()
    return frozenset(f"layers.{i}.{a}" for i in range(m.num_layers) if m.is_moe(i) for a in arrays)


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
