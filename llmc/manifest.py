"""The manifests: the only contract between export, build and run.

`llmc.json` (written by export) describes the model, the two graphs and their I/O, the KV-cache layout, limits,
tool versions and file checksums. `engine.json` (written by build) says what was built from which export.
Both carry a format version; a reader refuses a version it does not know.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from llmc.errors import ManifestError

EXPORT_MANIFEST = "llmc.json"
ENGINE_MANIFEST = "engine.json"
EXPORT_FORMAT_VERSION = 1
ENGINE_FORMAT_VERSION = 1
# the layer types with a KV cache ("hybrid": attention and a Mamba-2 mixer side by side, Falcon-H1's; "zamba": an
# attention block into a Mamba-2 mixer's input, Zamba2's)
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "zamba")


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. Symbolic dims are strings (e.g. "batch"), fixed ones ints."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class GraphSpec:
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # "last": logits only at each row's last valid position [B, 1, V]; "all": [B, S, V].
    logits: str = "last"

    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts the graphs were built from (and a backend may rebuild them from).

    The fields after `tie_embeddings` switch on what the newer families add; their defaults are a plain Llama, so
    manifests written before them still read.
    """

    family: str  # "llama" (every RoPE decoder: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, ...) or "gpt2"
    hf_architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    norm: str  # "rms" | "layer"
    norm_eps: float
    activation: str  # "silu" | "gelu" | "gelu_tanh" | "relu" | "relu2" (squared)
    positions: str  # "rope" | "learned"
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_attention_scaling: float = 1.0
    qkv_bias: bool = False
    tie_embeddings: bool = False
    # attention, per layer
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" | "chunked_attention" | "conv" |
    # "linear_attention" | "mamba" | "hybrid" (full attention and a Mamba-2 mixer on the same input, their outputs
    # added: Falcon-H1) | "mlp" (no mixer: the MLP alone, on the layer's norm1) per layer; empty: all full
    sliding_window: int = 0  # W: a sliding layer's query sees its last W positions (itself included)
    attention_chunk: int = 0  # C: a chunked layer's query at p sees the keys of its block, floor(p / C) * C .. p (Llama 4)
    rope_layers: tuple[bool, ...] = ()  # False: a layer without rotary (SmolLM3's NoPE layers); empty: all rotary
    rotary_dim: int = 0  # leading dims of each head that are rotated (partial rotary, Phi-4-mini); 0: all
    rope_local_attention_scaling: float = 1.0  # sliding layers' own rotary table (Gemma 3), when the export has one
    rope_long_after: int = 0  # longrope: a row past this many positions uses the long-factor table (Phi-3 128k)
    attention_scale: float = 0.0  # q.k multiplier; 0: 1 / sqrt(head_dim)
    # queries times 1 + beta * log(1 + floor((position + query_scale_offset) / query_scale_after)); beta 0: none
    # (Ministral 3: offset 0, every layer; Llama 4: offset 1, only its layers without rotary: query_scale_nope_only)
    query_scale_beta: float = 0.0
    query_scale_after: int = 0
    query_scale_offset: int = 0
    query_scale_nope_only: bool = False
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) (Gemma 2); 0: none
    clip_qkv: float = 0.0  # q, k and v clamped to [-c, c] (OLMo); 0: not
    qk_norm: str = ""  # "head": RMSNorm over each head of q and k (Qwen3, Gemma 3); "full": over all of q / k (OLMo 2)
    qk_norm_layers: tuple[bool, ...] = ()  # which layers have the qk-norm (Llama 4: its rotated ones); empty: all
    qk_norm_after_rope: bool = False  # q and k normed after their rotation, not before (Hunyuan)
    attn_output_gate: bool = False  # the attention's output times sigmoid(h @ attn_gate) before o (AFMoE)
    attn_gate_activation: str = "sigmoid"  # the gate's function: "sigmoid" (AFMoE, MiniCPM5) | "softplus" (Laguna)
    # the residual stream
    norm_layout: str = "pre"  # "pre" | "sandwich": also after attention and MLP (Gemma) | "post": only after (OLMo 2)
    norm_layouts: tuple[str, ...] = ()  # per layer, where layers differ (OLMo Hybrid's); empty: norm_layout for all
    embedding_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite: embedding_multiplier)
    embed_norm: bool = False  # the embeddings RMS-normed (weights embed_norm.weight) before the first block (NanoChat)
    residual_scale: float = 1.0  # each block's output times this before the residual add (Granite)
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) (Gemma 2)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    # "shared": attention and MLP both read the block's one norm, x + attn(ln1(x)) + mlp(ln1(x)) (StableLM, Phi-2);
    # "two": each its own, x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX); "": one after the other
    parallel_block: str = ""
    # the MLP
    plain_mlp: bool = False  # the MLP is proj(act(h @ fc)), no gate (StarCoder2; GPT-2's always is)
    # mixture of experts: 0 experts is a dense MLP
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1 (Mixtral always does)
    moe_layers: tuple[bool, ...] = ()  # which layers are mixtures; empty: all of them (when num_experts > 0)
    # a SwiGLU expert every token runs beside the routed ones, times sigmoid(h @ its gate) (Qwen2-MoE) or added as
    # it is (shared_expert_gated False: GLM-4.5, DeepSeek-V3's shared experts as one MLP); 0: none
    shared_expert_size: int = 0
    shared_expert_gated: bool = True
    # routing: "softmax" (softmax over the experts, top k) or "sigmoid" (DeepSeek-V3 / GLM-4.5: sigmoid scores, the
    # top k of scores + router.correction_bias within the moe_topk_groups best of moe_groups groups, the scores of
    # those, times routed_scaling), "softmax_biased" (ERNIE 4.5), "softmax_grouped" (DeepSeek-V2) or "sigmoid_logits"
    # (Kolibri-1) or "sparsemixer" (PhiMoE): llmc/graph/moe.py
    moe_routing: str = "softmax"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling: float = 1.0
    moe_router_fp32: bool = False  # "softmax" routing's router in fp32 whatever the dtype (Hunyuan; the others always)
    moe_post_norm: bool = False  # the mixture's output (routed + shared) normed (layers.{i}.moe_norm) (A.X K1)
    moe_scale_inputs: bool = False  # each expert runs on its input times its routing weight, its output unweighted
    # (Llama 4)
    moe_jitter_eps: float = 0.0  # "sparsemixer" routing's threshold (PhiMoE: config.router_jitter_noise)
    moe_norm_eps: float = 1e-20  # "sigmoid" routing, renormalized: added to the k scores' sum (LFM2-MoE: 1e-6)
    # the experts run on h @ moe_latent_in [hidden, L] and their weighted sum goes back through moe_latent_out
    # [L, hidden]; the router reads h (Nemotron-H's latent experts); 0: none
    moe_latent_size: int = 0
    # the mixture runs beside the layer's dense MLP on the block's input x (Gemma 4 26B-A4B): the MLP's output is
    # normed (mlp_out_norm), the router reads router_norm(x) (its scale and 1 / sqrt(hidden) as the norm's weights),
    # the experts moe_in_norm(x), their sum is normed (moe_out_norm) and the two added
    moe_beside_mlp: bool = False
    # GPT-OSS's experts: "swiglu_oss" is (clamp(up, -L, L) + 1) * g * sigmoid(alpha g), g = min(gate, L), with
    # L = swiglu_limit, alpha = swiglu_alpha; moe_bias: the router and every expert's products have biases
    moe_activation: str = "silu"
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    moe_bias: bool = False
    # one learned logit a query head joins each softmax with (its value 0): GPT-OSS's attention sinks,
    # weights layers.{i}.attn.sinks [H]
    attn_sinks: bool = False
    # multi-head latent attention (DeepSeek-V2 / V3, GLM-4.7-Flash), held as its latent: every query head meets one
    # KV head of head_dim = mla_kv_rank + rotary_dim, [rotated key | normed latent c], the values the same rows (the
    # attention's output of each head is c's weighted sum there, times the head's W_UV); the queries are
    # [rotated q_rope | q_nope @ W_UK] per head (W_UK / W_UV: the key / value halves of kv_b_proj, folded as
    # layers.{i}.attn.k_up [H, nope, C] and layers.{i}.attn.v_up [H, C, V]); 0: not MLA
    mla_kv_rank: int = 0  # C: the latent's width (config.kv_lora_rank)
    mla_q_rank: int = 0  # the queries' low rank (config.q_lora_rank): q_a -> q_a_norm -> q_b; 0: one q product
    mla_nope_dim: int = 0  # each query head's dims without rotary (config.qk_nope_head_dim)
    mla_v_dim: int = 0  # each head's value width after v_up (config.v_head_dim)
    # a "conv" layer has no attention: a gated short convolution (LFM2), B, C, x = h @ conv_in;
    # y = C * conv(B * x) @ o, conv a causal depthwise convolution of conv_kernel taps (layers.{i}.conv.weight
    # [taps, hidden], tap taps - 1 on the newest input); each sequence keeps its last conv_kernel - 1 inputs B * x
    # as a state beside the KV cache (KVSpec.states)
    conv_kernel: int = 0
    # a "linear_attention" layer is a gated delta rule (Qwen3.5's Gated DeltaNet) in the attention's place: q, k, v
    # (linear_k_heads / linear_v_heads heads of linear_k_dim / linear_v_dim) through a causal depthwise convolution of
    # linear_conv_kernel taps and SiLU, a recurrent state [v heads, k dim, v dim] per sequence decayed by
    # exp(-exp(A_log) softplus(h @ a + dt_bias)) and written by sigmoid(h @ b) each token (llmc/graph/linear_attention.py)
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv_kernel: int = 0
    # "kda": Kimi Delta Attention's form of it: a decay per key dim, g = -exp(A_log) softplus(h @ f_a @ f_b + dt_bias),
    # q, k, v, f_a, b and g_a from one product (kda_in), the output RMS-normed times sigmoid(h @ g_a @ g_b)
    linear_kind: str = "gated_delta"
    linear_beta_scale: float = 1.0  # beta times this (OLMo Hybrid's linear_allow_neg_eigval: 2, beta in [0, 2])
    linear_norm_eps: float = 0.0  # the output norm's epsilon; 0: norm_eps (OLMo Hybrid's is 1e-5 whatever the model's)
    # a "mamba" layer is a Mamba-2 mixer in the attention's place: z, xBC, dt = h @ mamba_in; xBC through a causal
    # depthwise convolution of mamba_conv_kernel taps (and bias) and SiLU, split into x (mamba_heads heads of
    # mamba_head_dim), B and C (mamba_groups groups of mamba_state; head h reads group h // (heads / groups)); per
    # token, on a state M [heads, state, head_dim] per sequence: M <- M exp(dt A) + B^T (dt x), A = -exp(A_log),
    # dt = softplus(dt + dt_bias); y = C M + D x; then y silu(z) RMS-normed in mamba_groups groups (mamba_norm
    # "after_gate"; "before_gate": y normed, then times silu(z); "none": y silu(z) alone), then its output product
    # mamba_out (llmc/graph/linear_attention.py)
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 1
    mamba_conv_kernel: int = 0
    mamba_norm: str = "after_gate"
    # 1: a "mamba" layer is a Mamba-1 mixer instead (Mamba, Falcon Mamba, Jamba): x, z = h @ mamba_in; x through the
    # convolution and SiLU; dt, B, C = x @ mamba_x (mamba_dt_rank, mamba_state, mamba_state wide; each RMS-normed
    # where mamba_bcdt_norm, with mamba_norm_eps or else norm_eps); dt = softplus(dt @ mamba_dt + bias); per channel
    # c and state element n: M[n][c] <- M[n][c] exp(dt[c] A[c][n]) + B[n] dt[c] x[c], A = -exp(A_log); y = C M + D x;
    # y silu(z) @ mamba_out. Its channels are held as mamba_heads heads of mamba_head_dim (one group of B and C)
    mamba_version: int = 2
    mamba_dt_rank: int = 0
    mamba_bcdt_norm: bool = False
    mamba_norm_eps: float = 0.0  # the mixer's own norms' epsilon (Mamba-1's dt, B, C; Mamba-2's gated one); 0: norm_eps
    mamba_dt_min: float = 0.0  # dt = max(dt, this) after its softplus (Zamba2's time_step_min, as its trained scan)
    # a "zamba" layer (Zamba2's hybrid layers) is a Mamba-2 mixer layer whose mixer input is norm1(x + t): t the
    # shared attention block zamba_blocks[layer] ("shared.{b}": norm zamba_in on [x, the embeddings], 2 x hidden wide;
    # attention; o; norm zamba_mid; its MLP gate_up / down), each of qkv and gate_up plus the layer's own adapter
    # (x @ {name}_adapter_a @ {name}_adapter_b) where it has one, through the layer's zamba_linear; t joins the
    # residual stream only through the mixer
    zamba_blocks: tuple[int, ...] = ()
    mlp_layers: tuple[bool, ...] = ()  # which layers have an MLP after the mixer (Nemotron-H's have none); empty: all
    # each layer's head dim and KV heads where the layers differ (Gemma 4's full layers: heads twice as wide, fewer
    # KV heads); empty: head_dim / num_kv_heads for every layer. Each KV layer's cache is then its own shape
    # (KVSpec.layer_dims)
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    v_norm: bool = False  # v RMS-normed over each head too, as q and k (layers.{i}.v_norm.weight; Gemma 4: ones)
    # the layers whose values are their keys' projection (Gemma 4's full layers, attention_k_eq_v): qkv holds q and k,
    # and k is taken again as v before the norms (v_norm(k), rope(k_norm(k))); empty: none
    k_eq_v_layers: tuple[bool, ...] = ()
    layer_scalars: tuple[float, ...] = ()  # the residual stream times this after each layer (Gemma 4); empty: none
    # the layer whose KV cache each layer attends: itself, or (Gemma 4 E2B / E4B's last layers) an earlier layer of
    # the same kind, whose keys and values it reads as they are, with its own queries (it has no k / v, and no cache
    # of its own: qkv holds q alone); empty: every attention layer its own
    kv_sources: tuple[int, ...] = ()
    # per-layer embeddings (Gemma 4 E2B / E4B), P wide a layer: ple = (norm_P((x @ ple_proj) / sqrt(hidden)) +
    # embed_per_layer[ids] sqrt(P)) / sqrt(2) [B, S, layers, P] from the scaled embeddings x; after each layer's MLP,
    # x += ple_norm(((act(x @ ple_gate)) * ple[:, :, i]) @ ple_out) (before its layer scalar); 0: none
    per_layer_input_size: int = 0
    layer_intermediate_sizes: tuple[int, ...] = ()  # each layer's MLP width where they differ (Gemma 4's KV-shared
    # layers' double-wide MLPs); empty: intermediate_size for all
    # the head's rows where fewer than the embeddings' (Apertus 1.5: its multimodal output rows pruned): the logits are
    # this wide and the ids the model can produce 0..output_vocab_size - 1, while its inputs take any of vocab_size;
    # 0: vocab_size (logits_size)
    output_vocab_size: int = 0
    # a mixture of attention (JetMoE): each token's query and output products are those of the top moa_top_k of
    # moa_experts experts (router layers.{i}.moa_router [hidden, E], softmax over the chosen logits); expert e's q
    # layers.{i}.moa.{e}.q [hidden, Hkv * D] and o layers.{i}.moa.{e}.o [Hkv * D, hidden], keys and values shared
    # (layers.{i}.kv), the chosen experts' queries the attention's num_heads = Hkv * top_k heads in the order (kv head,
    # slot): query head h * top_k + j reads KV head h; each slot's output times its weight through its expert's o,
    # layers.{i}.moa.bias added once; 0: none
    moa_experts: int = 0
    moa_top_k: int = 0
    # indexed attention (Kolibri 1.1's "indexed_attention" layers, full attention without rotary): keys and values
    # rounded to NVFP4 before they are cached (E2M1 values, an E4M3 scale per 16 of a head's dims); a query seeing
    # more than index_sink + index_topk + index_local keys attends to its first index_sink, its last index_local
    # (itself included) and the index_topk others whose routing score sum_{h < index_heads} relu(nvfp4(q_h) . k[t])
    # over KV head 0's keys is highest (ties: the earlier key), every key it sees being its pool (engines hold
    # max_positions <= the model's pool size); empty: none
    index_layers: tuple[bool, ...] = ()
    index_topk: int = 0
    index_local: int = 0
    index_sink: int = 0
    index_heads: int = 0
    # BitNet b1.58: the attention's heads RMS-normed over all H * D (layers.{i}.attn_sub_norm) before o, and the
    # MLP's act(gate) * up (layers.{i}.mlp_sub_norm) before down
    sub_norms: bool = False
    # "int8_token": every decoder layer's linear product (not the head) takes its input rounded per token to the
    # int8 grid of its largest |x| (BitNet's activation quantization: round(x s) / s, s = 127 / max(max |x|, 1e-5));
    # "": its input as it is
    act_quant: str = ""

    @property
    def logits_size(self) -> int:
        """The logits' width: the ids the model can produce (output_vocab_size where the head is pruned)."""
        return self.output_vocab_size or self.vocab_size

    def indexed(self, layer: int) -> bool:
        """The layer's attention is indexed (index_layers): NVFP4 keys and values, each query's keys chosen past
        index_budget of them."""
        return bool(self.index_layers) and self.index_layers[layer]

    @property
    def index_budget(self) -> int:
        """The most keys an indexed layer's query attends: up to this many it sees them all."""
        return self.index_sink + self.index_topk + self.index_local

    def window(self, layer: int) -> int:
        """The layer's sliding window W (0: full attention)."""
        types = self.layer_types
        return self.sliding_window if types and types[layer] == "sliding_attention" else 0

    def chunk(self, layer: int) -> int:
        """The layer's attention chunk C (0: none)."""
        types = self.layer_types
        return self.attention_chunk if types and types[layer] == "chunked_attention" else 0

    def scales_queries(self, layer: int) -> bool:
        return bool(self.query_scale_beta) and not (self.query_scale_nope_only and self.has_rope(layer))

    def has_rope(self, layer: int) -> bool:
        return self.positions == "rope" and (not self.rope_layers or self.rope_layers[layer])

    def is_conv(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "conv"

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def is_mamba(self, layer: int) -> bool:
        """The layer has a Mamba mixer ("mamba", or "hybrid" beside its attention, or "zamba" after it; Mamba-2's, or
        mamba_version's)."""
        return bool(self.layer_types) and self.layer_types[layer] in ("mamba", "hybrid", "zamba")

    def has_mixer(self, layer: int) -> bool:
        return not self.layer_types or self.layer_types[layer] != "mlp"

    def has_mlp(self, layer: int) -> bool:
        return not self.mlp_layers or self.mlp_layers[layer]

    def attends(self, layer: int) -> bool:
        """The layer attends (with a KV cache): not a "conv", "linear_attention", "mamba" or "mlp" one."""
        return not self.layer_types or self.layer_types[layer] in ATTENTION_TYPES

    @property
    def has_states(self) -> bool:
        """Some layer keeps a state per sequence beside the KV cache (a convolution, a linear attention, a Mamba-2
        mixer, Falcon-H1's beside its attention included)."""
        return any(self.is_conv(i) or self.is_linear(i) or self.is_mamba(i) for i in range(self.num_layers))

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache layer `layer` attends (kv_sources): its own, or an earlier layer's."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def k_eq_v(self, layer: int) -> bool:
        """The layer's values are its keys' projection (k_eq_v_layers): its qkv product holds q and k alone (a layer
        reading another's cache has neither)."""
        return bool(self.k_eq_v_layers) and self.k_eq_v_layers[layer] and not self.shares_kv(layer)

    def shares_kv(self, layer: int) -> bool:
        """The layer attends an earlier layer's cache (kv_sources), with no keys and values of its own."""
        return self.kv_source(layer) != layer

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache of their own (the attention layers but those reading another's cache), in
        order: KV layer j is layer kv_layers[j]."""
        return tuple(i for i in range(self.num_layers) if self.attends(i) and not self.shares_kv(i))

    def kv_index(self, layer: int) -> int:
        """The place among the KV layers of the cache layer `layer` attends (its cache's name index)."""
        source = self.kv_source(layer)
        return source if len(self.kv_layers) == self.num_layers else self.kv_layers.index(source)

    def state_index(self, layer: int) -> int:
        """A conv, linear-attention or Mamba-2 layer's place among the layers of its kind (its states' name index)."""
        def kind(i: int) -> str:
            return "mamba" if self.is_mamba(i) else self.layer_types[i]

        return sum(1 for i in range(layer) if kind(i) == kind(layer))

    def layout(self, layer: int) -> str:
        """Where layer `layer`'s norms sit: "pre", "sandwich" or "post" (norm_layout, or its own of norm_layouts)."""
        return self.norm_layouts[layer] if self.norm_layouts else self.norm_layout

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    @property
    def rotated_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def scale_of(self, layer: int) -> float:
        """Layer `layer`'s scores' multiplier."""
        return self.attention_scale or self.head_dim_of(layer) ** -0.5

    def rotated_dims_of(self, layer: int) -> int:
        return self.rotary_dim or self.head_dim_of(layer)

    @property
    def per_layer_attention(self) -> bool:
        """Layers of different head sizes or KV heads, or reading each other's caches (Gemma 4)."""
        return bool(self.layer_head_dims or self.layer_kv_heads or self.kv_sources)

    def intermediate_of(self, layer: int) -> int:
        """Layer `layer`'s (dense) MLP width."""
        return self.layer_intermediate_sizes[layer] if self.layer_intermediate_sizes else self.intermediate_size

    def layer_scalar(self, layer: int) -> float:
        return self.layer_scalars[layer] if self.layer_scalars else 1.0


@dataclass(frozen=True)
class StateSpec:
    """A fixed-size state each sequence keeps for some layers beside its KV cache (a short convolution's last
    inputs): `count` tensors [B, *shape] in as `past` and out as `present` (templates with {i}, the i-th such
    layer), written whole by each run. Held in `dtype` whatever the compute dtype."""

    past: str
    present: str
    count: int
    shape: tuple[int, ...]
    dtype: str = "float32"
    # in place (every in-place graph's): past and present are one pool [num_slots, *shape] bound as both, row b's
    # state the pool's state_rows[b]-th; not copied in and out each run
    pooled: bool = False

    def names(self, kind: str) -> list[str]:
        return [(self.past if kind == "past" else self.present).format(i=i) for i in range(self.count)]


KV_INT8_GROUP = 32  # an "int8" KV row: one fp16 scale per this many values (llmc/engines/kernels/attention_kernel.h)
KEY_TILE = 16  # a key_tiles cache: positions per group of keys held as [head_dim][16] (LLMC_KEY_TILE there)


@dataclass(frozen=True)
class KVSpec:
    """KV cache layout. "concat": past [B, Hkv, P, D] in, present [B, Hkv, P+S, D] out (Optimum style).

    A later layout ("inplace": one [B, Hkv, max_len, D] buffer bound as past and present) is a different value
    here, not a different CLI. dtype "int8" (llmc's attention operator only): rows of D int8 and an fp16 scale per
    group of 32, [B, Hkv, L, D + 2 ceil(D / 32)] (`row_width`); the keys are held times a 32-point Hadamard matrix
    on each whole 32 of their dims (the queries meet them through the same one: the same scores).
    """

    layout: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    past_key: str  # name template with {i}
    past_value: str
    present_key: str
    present_value: str
    # "inplace" only: the buffers are pools of KV blocks [num_blocks, Hkv, block_size, row] shared by the batch's
    # rows, addressed through a block_table [B, max_blocks] input (llmc's attention operator): paged KV memory
    paged: bool = False
    # paged fp32 / fp16 pools of llmc's operator: the keys of each 16 aligned positions of a block held in their
    # 16 rows' bytes as [head_dim][16] (the operator's key_tiles; the values stay rows); blocks of 16 or more
    key_tiles: bool = False
    # per-sequence states of layers without a KV cache (LFM2's convolutions), beside it; num_layers counts only the
    # layers with KV
    states: tuple[StateSpec, ...] = ()
    # each KV layer's (KV heads, head dim) where the layers differ (ModelSpec.layer_head_dims); empty: num_kv_heads
    # and head_dim for all
    layer_dims: tuple[tuple[int, int], ...] = ()

    def dims(self, j: int) -> tuple[int, int]:
        """KV layer j's (KV heads, head dim)."""
        return self.layer_dims[j] if self.layer_dims else (self.num_kv_heads, self.head_dim)

    def row_of(self, j: int) -> int:
        """Elements of one cached (head, position) row of KV layer j (row_width of its head dim)."""
        return _row_width(self.dtype, self.dims(j)[1])

    def buffer_shape(self, j: int, lead: int, length: int) -> tuple[int, int, int, int]:
        """KV layer j's K (or V) buffer: [lead (slots, rows or blocks), its KV heads, length, its row]."""
        return (lead, self.dims(j)[0], length, self.row_of(j))

    def bytes_per_token(self) -> int:
        """The K and V bytes one position takes over every KV layer."""
        return 2 * self.itemsize * sum(self.dims(j)[0] * self.row_of(j) for j in range(self.num_layers))

    def state_names(self, kind: str) -> list[str]:
        """Every state tensor's name of one kind ("past" or "present"), in the graphs' order."""
        return [n for s in self.states for n in s.names(kind)]

    @property
    def row_width(self) -> int:
        """Elements of one cached (head, position) row: head_dim, or for "int8" head_dim int8 values followed by
        one fp16 scale (2 bytes) per group of KV_INT8_GROUP of them (x = scale * q), as llmc's attention operator
        keeps them."""
        return _row_width(self.dtype, self.head_dim)

    @property
    def itemsize(self) -> int:
        return {"float16": 2, "int8": 1}.get(self.dtype, 4)

    def names(self, kind: str) -> list[str]:
        """All per-layer names of one kind: "past" or "present", keys and values interleaved by layer."""
        k, v = (self.past_key, self.past_value) if kind == "past" else (self.present_key, self.present_value)
        return [n.format(i=i) for i in range(self.num_layers) for n in (k, v)]


def _row_width(dtype: str, head_dim: int) -> int:
    return head_dim if dtype != "int8" else head_dim + 2 * -(-head_dim // KV_INT8_GROUP)


@dataclass(frozen=True)
class GenerationSpec:
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    has_chat_template: bool = False


@dataclass(frozen=True)
class ExportManifest:
    model_name: str
    source: str
    dtype: str
    opset: int
    model: ModelSpec
    kv: KVSpec
    prefill: GraphSpec
    decode: GraphSpec
    generation: GenerationSpec
    weights_file: str
    golden_file: str
    tools: dict[str, str]
    files: dict[str, str]  # file name -> sha256
    parity: dict[str, float] = field(default_factory=dict)
    format: str = "llmc-export"
    format_version: int = EXPORT_FORMAT_VERSION

    @property
    def max_positions(self) -> int:
        return self.model.max_positions


@dataclass(frozen=True)
class EngineSettings:
    """What a build chose, what the runtime needs from it, and what the build measured; each backend fills its
    part (the defaults: not applicable)."""

    threads: int = 0  # the engine's default intra-op threads
    kv_layout: str = "inplace"
    attention: str = ""
    precision: str = ""
    # ONNX Runtime engines
    optimization: str = ""
    quant: str = "none"
    dtype: str = ""  # the linear layers' weights (bfloat16: llmc's MatMulBF16)
    kv_dtype: str = ""
    matmul: str = ""
    moe: str = ""
    block_size: int = 0
    accuracy_level: int = 0
    onnxruntime: str = ""
    llmc_ops: str = ""  # llmc's operators' contract version the graphs were built for ("": none used)
    custom_ops: str = ""  # llmc 0.1 engines: their own operator library, a file in the engine folder
    # TensorRT engines
    limits: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, Any] = field(default_factory=dict)
    tensorrt: str = ""
    gpu: str = ""
    compute_capability: str = ""
    fp32_layers: dict[str, Any] = field(default_factory=dict)
    timing_cache: str = ""
    # measured by the build
    parity: dict[str, float] = field(default_factory=dict)  # the golden check (runtime/verify.py check_golden)
    quality: dict[str, Any] = field(default_factory=dict)  # --quality-target's choice and measurement


@dataclass(frozen=True)
class EngineManifest:
    backend: str
    precision: str
    export_dir: str
    export_manifest_sha256: str
    model_name: str
    model: ModelSpec
    kv: KVSpec
    prefill: GraphSpec
    decode: GraphSpec
    generation: GenerationSpec
    settings: EngineSettings
    tools: dict[str, str]
    files: dict[str, str]
    format: str = "llmc-engine"
    format_version: int = ENGINE_FORMAT_VERSION

    @property
    def max_positions(self) -> int:
        return self.model.max_positions


T = TypeVar("T")


def _build(tp: Any, value: Any, where: str) -> Any:
    """Rebuild a (nested) dataclass value from JSON data, following the type hints and checking each value's type:
    a manifest of the wrong shape is a `ManifestError` naming the field, never an AttributeError later."""
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise ManifestError(f"{where or 'the manifest'} must be an object, got {_show(value)}")
        hints = get_type_hints(tp)
        for f in fields(tp):
            if f.name not in value and f.default is MISSING and f.default_factory is MISSING:
                raise ManifestError(f"{_join(where, f.name)} is missing")
        return tp(**{f.name: _build(hints[f.name], value[f.name], _join(where, f.name))  # type: ignore[operator]
                     for f in fields(tp) if f.name in value})
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, UnionType):
        for option in args:
            try:
                return _build(option, value, where)
            except ManifestError:
                continue
        raise ManifestError(f"{where} must be {' or '.join(_name(a) for a in args)}, got {_show(value)}")
    if origin is tuple:
        if not isinstance(value, list):
            raise ManifestError(f"{where} must be a list, got {_show(value)}")
        return tuple(_build(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ManifestError(f"{where} must be an object, got {_show(value)}")
        return {k: _build(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is type(None):
        if value is not None:
            raise ManifestError(f"{where} must be null, got {_show(value)}")
        return value
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool)}[tp](value)
    if not ok:
        raise ManifestError(f"{where} must be {_name(tp)}, got {_show(value)}")
    return float(value) if tp is float else value


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            type(None): "null"}.get(tp, "an object" if is_dataclass(tp) else str(tp))


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else type(value).__name__.replace("dict", "an object")
    return text if len(text) <= 40 else text[:37] + "..."


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def save(manifest: ExportManifest | EngineManifest, directory: Path) -> Path:
    name = EXPORT_MANIFEST if isinstance(manifest, ExportManifest) else ENGINE_MANIFEST
    path = Path(directory) / name
    path.write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    return path


def _load(cls: type[T], path: Path, fmt: str, version: int) -> T:
    if not path.is_file():
        raise ManifestError(f"no manifest at {path}: is this an llmc {fmt.split('-')[1]} directory?")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ManifestError(f"manifest {path} must hold a JSON object, got {_show(data)}")
    if data.get("format") != fmt:
        raise ManifestError(f"{path} has format {data.get('format')!r}, expected {fmt!r}")
    if data.get("format_version") != version:
        raise ManifestError(
            f"{path} has format_version {data.get('format_version')}, this llmc reads version {version}; "
            "re-run the stage that wrote it"
        )
    try:
        return _build(cls, data, "")  # type: ignore[no-any-return]
    except ManifestError as e:
        raise ManifestError(f"manifest {path}: {e}") from None


def load_export(directory: Path | str) -> ExportManifest:
    return _load(ExportManifest, Path(directory) / EXPORT_MANIFEST, "llmc-export", EXPORT_FORMAT_VERSION)


def load_engine(directory: Path | str) -> EngineManifest:
    return _load(EngineManifest, Path(directory) / ENGINE_MANIFEST, "llmc-engine", ENGINE_FORMAT_VERSION)


def verify_files(directory: Path, files: dict[str, str]) -> None:
    """Check every recorded checksum; a modified or missing file is a clear error."""
    for name, expected in files.items():
        path = Path(directory) / name
        if not path.is_file():
            raise ManifestError(f"{path} is listed in the manifest but missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ManifestError(f"{path} was modified: sha256 {actual[:12]}… != recorded {expected[:12]}…")
