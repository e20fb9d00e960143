"""The decoder written directly as ONNX: prefill and decode-with-past graphs.

No tracing of transformers' modeling code (and its cache classes): every node is placed here, so the graphs stay
the same across transformers versions and the parity tests decide whether they are right. One layer loop serves every
family: the norms before and/or after attention and the MLP (`norm_layout`), q/k norms, per-layer rotary and
sliding windows, multipliers and soft-caps are switched on by the ModelSpec. The attention lowerings are in
attention.py; linear layers become MatMulNBits when their weights were quantized, or llmc's own ai.llmc.MatMulQ4 when
they were packed for it (the SwiGLU MLP's gate and up projections then one node with the gate applied); mixtures of
experts are in moe.py.
Shapes in comments: B batch, S new tokens, Hd hidden size, H / Hkv heads, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from llmc.graph import io_names as io
from llmc.graph.attention import LOWERINGS, CachedAttention, Rotary, layer_rope_table, nvfp4, rotate_packed
from llmc.graph.builder import DTYPES, GraphBuilder
from llmc.graph.checkpoint import XIELU, Checkpoint
from llmc.graph.layers import (
    CALIBRATE_POSITIONS,
    LLMC_DOMAIN,
    MS,
    Ctx,
    GraphOptions,
    gated_product,
    gated_tiles,
    gelu_tanh,
    linear,
    norm,
    skip_norm,
    softcap,
)
from llmc.graph.linear_attention import gated_delta_net, kimi_delta_attention, mamba, short_conv
from llmc.graph.moe import moe_mlp
from llmc.graph.quant import BF16TILES, EMBED_BF16, EMBED_Q8, EMBED_Q8_SCALES, Q4TILES, Q8TILES, QWEIGHT
from llmc.graph.resume import resumable
from llmc.manifest import GraphSpec

__all__ = ["LLMC_DOMAIN", "MS", "GraphOptions", "build_graph"]


def build_graph(ckpt: Checkpoint, spec: GraphSpec, dtype: str, opset: int,
                opts: GraphOptions | None = None) -> tuple[onnx.GraphProto, list[str]]:
    """Build one graph (prefill when it has no past inputs); returns it and the weight names it uses."""
    opts = opts or GraphOptions()
    names = set(spec.input_names())
    c = Ctx(GraphBuilder(opset, dtype), ckpt.spec, ckpt, opts, with_past=io.PAST_KEY.format(i=0) in names
            and opts.attention == "decomposed", inputs=frozenset(names))
    b, m = c.b, c.m
    x = _embed(c)  # [B, S, Hd]
    if m.embedding_scale != 1.0:
        x = b.op("Mul", x, b.scalar(m.embedding_scale))
    if m.positions == "learned":
        x = b.op("Add", x, b.op("Gather", b.weight("pos_embed.weight"), io.POSITION_IDS))
    if m.embed_norm:
        x = norm(c, x, "embed_norm")
    attend = LOWERINGS[opts.attention](c)
    ple = _per_layer_inputs(c, x) if m.per_layer_input_size else None
    last_token = attend.last_token if spec.logits == "last" else None
    narrow = False
    if last_token is not None and isinstance(attend, CachedAttention) and attend.reads_last_tokens_only():
        attend.shared_last_only = narrow = True  # (its KV-shared layers' nodes then take one token a row)
    h = _layers(c, x, attend, last_token, ple, narrow)
    if CALIBRATE_POSITIONS in names:  # calibration: the head only where logits are scored, [1, N, Hd]
        h = b.unsqueeze(b.op("GatherND", h, CALIBRATE_POSITIONS), 0)
    _lm_head(c, h)
    graph = helper.make_graph(b.nodes, spec.file.removesuffix(".onnx"), [_value_info(t) for t in spec.inputs],
                              [_value_info(t) for t in spec.outputs], initializer=list(b.constants.values()))
    if opts.resume:
        resumable(graph, c.blocks, {n: helper.np_dtype_to_tensor_dtype(ckpt.weights[n].dtype)
                                    for n in b.weights_used})
    return graph, b.weights_used


def _value_info(t: object) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, DTYPES[t.dtype], list(t.shape))  # type: ignore[attr-defined]


def _layers(c: Ctx, x: str, attend: Callable[[int, str], str], last_token: Callable[[str], str] | None,
            ple: str | None = None, narrow: bool = False) -> str:
    """Every block; returns the final norm's output (of each row's last token when `last_token` is given). `ple`:
    the per-layer embeddings [B, S, layers, P] (_per_layer_inputs), each layer's added after its MLP. `narrow`: from
    the first layer reading another's cache on (Gemma 4 E2B / E4B's last layers, which write no cache), only each
    row's last token goes on (as transformers' generate runs them): the rest of a prompt's tokens feed no cache and
    no logits past there."""
    m = c.m
    fuse = c.opts.fuse_norms and m.norm_layout != "post"  # (OLMo 2 norms only block outputs: nothing to fuse)
    embeddings = x  # (what Zamba2's attention blocks read beside the residual stream)

    def pre_norm(layer: int, name: str) -> str | None:  # a block's norm before it, or none (a "post" layer's; a
        # "zamba" layer norms x + its attention block's output itself: _zamba_input)
        if m.layout(layer) == "post" or (name == "norm1" and m.layer_types[layer:layer + 1] == ("zamba",)):
            return None
        return f"layers.{layer}.{name}"

    first = pre_norm(0, "norm1")
    h = x if first is None else norm(c, x, first)
    rotary = Rotary(c)  # (the attention rotates q and k, unless their norms follow the rotation)
    query_scale = _query_scale(c) if m.query_scale_beta else None
    narrowed = False
    for i in range(m.num_layers):
        c.blocks.append(len(c.b.nodes))
        p = f"layers.{i}"
        if narrow and last_token is not None and m.shares_kv(i) and not narrowed:
            x, h, narrowed = last_token(x), last_token(h), True
            ple = last_token(ple) if ple is not None else None
        if not m.has_mixer(i):  # (Nemotron-H's MLP blocks) the MLP alone, on the layer's norm1
            delta = _block_output(c, i, _mlp(c, i, h), f"{p}.post_mlp_norm")
        else:
            if m.is_conv(i):  # (LFM2) a gated short convolution in the attention's place
                mixed = linear(c, short_conv(c, i, h), f"{p}.o")
            elif m.is_linear(i):  # (Qwen3.5) a Gated DeltaNet, (Kimi Linear) its per-key-dim decay form
                mixer = kimi_delta_attention if m.linear_kind == "kda" else gated_delta_net
                mixed = linear(c, mixer(c, i, h), f"{p}.o")
            elif m.layer_types[i:i + 1] == ("zamba",):  # (Zamba2) an attention block into its Mamba-2 mixer's input
                mixed = mamba(c, i, _zamba_input(c, i, x, embeddings, attend, rotary, query_scale))
            elif m.moa_experts:  # (JetMoE) a mixture of attention
                mixed = _mixture_of_attention(c, i, h, attend, rotary, query_scale)
            elif m.attends(i):  # attention, and (Falcon-H1's "hybrid" layers) a Mamba-2 mixer beside it
                mixed = linear(c, _attention(c, i, h, attend, rotary, query_scale), f"{p}.o")
                if m.is_mamba(i):
                    mixed = c.b.op("Add", mixed, mamba(c, i, h))
            else:  # (Granite 4.0-H, Bamba, Nemotron-H) a Mamba-2 mixer, (Mamba, Falcon Mamba, Jamba) a Mamba-1 one
                mixed = mamba(c, i, h)
            delta = _block_output(c, i, mixed, f"{p}.post_attn_norm")
        if m.has_mixer(i) and m.has_mlp(i):  # (else one block, whose output joins the residual stream below)
            if m.parallel_block:  # x + attn(ln1(x)) + mlp(ln1(x) or ln2(x)): one residual add for both
                mlp_in = h if m.parallel_block == "shared" else norm(c, x, f"{p}.norm2")
                delta = c.b.op("Add", delta, _block_output(c, i, _mlp(c, i, mlp_in), f"{p}.post_mlp_norm"))
            else:
                h, x = _residual(c, x, delta, pre_norm(i, "norm2"), fuse)
                delta = _block_output(c, i, _mlp(c, i, h, x), f"{p}.post_mlp_norm")
        if ple is not None:  # (Gemma 4 E2B / E4B) x + the MLP's output, then its per-layer embedding's delta
            x = c.b.op("Add", x, delta)
            delta = _per_layer_delta(c, i, x, ple)
        last = i + 1 == m.num_layers
        h, x = _residual(c, x, delta, "norm" if last else pre_norm(i + 1, "norm1"), fuse,
                         last_token if last and not narrowed else None, m.layer_scalar(i))
    return h


def _per_layer_inputs(c: Ctx, x: str) -> str:
    """Gemma 4's per-layer embeddings [B, S, layers, P] (ModelSpec.per_layer_input_size) from the scaled embeddings
    x: (norm_P((x @ ple_proj) / sqrt(hidden)) + embed_per_layer[ids] sqrt(P)) / sqrt(2)."""
    b, m = c.b, c.m
    P, L = m.per_layer_input_size, m.num_layers
    proj = b.op("Mul", linear(c, x, "ple_proj"), b.scalar(m.hidden_size ** -0.5))
    proj = norm(c, b.op("Reshape", proj, b.ints(0, 0, L, P)), "ple_norm")
    tokens = b.op("Mul", _lookup(c, "embed_per_layer.weight"), b.scalar(P ** 0.5))
    both = b.op("Add", proj, b.op("Reshape", tokens, b.ints(0, 0, L, P)))
    return b.op("Mul", both, b.scalar(2 ** -0.5))


def _per_layer_delta(c: Ctx, i: int, x: str, ple: str) -> str:
    """Layer i's per-layer embedding's addition to the residual stream x: ple_norm((act(x @ ple_gate) *
    ple[:, :, i]) @ ple_out)."""
    b, p = c.b, f"layers.{i}"
    mine = b.op("Squeeze", b.op("Gather", ple, b.ints(i), axis=2), b.ints(2))  # [B, S, P]
    gated = b.op("Mul", _activation(c, linear(c, x, f"{p}.ple_gate")), mine)
    return norm(c, linear(c, gated, f"{p}.ple_out"), f"{p}.ple_norm")


def _zamba_input(c: Ctx, i: int, x: str, embeddings: str, attend: Callable[[int, str], str], rotary: Rotary,
                 query_scale: str | None) -> str:
    """A Zamba2 hybrid layer's mixer input: norm1(x + t), t = its shared attention block (ModelSpec.zamba_blocks) on
    [x, the embeddings] (normed 2 x hidden wide, attention, o; normed, its MLP), the layer's own adapters on qkv and
    gate_up, through zamba_linear. t joins the residual stream only through the mixer."""
    b, p, s = c.b, f"layers.{i}", f"shared.{c.m.zamba_blocks[i]}"
    a = norm(c, b.op("Concat", x, embeddings, axis=-1), f"{s}.zamba_in")
    heads = _attention(c, i, a, attend, rotary, query_scale, qkv=_adapted(c, a, f"{s}.qkv", f"{p}.qkv_adapter"))
    t = norm(c, linear(c, heads, f"{s}.o"), f"{s}.zamba_mid")
    gate, up = b.split(_adapted(c, t, f"{s}.gate_up", f"{p}.gate_up_adapter"), [c.m.intermediate_size] * 2)
    t = linear(c, linear(c, b.op("Mul", _activation(c, gate), up), f"{s}.down"), f"{p}.zamba_linear")
    return norm(c, b.op("Add", x, t), f"{p}.norm1")


def _adapted(c: Ctx, x: str, name: str, adapter: str) -> str:
    """x @ W, plus x @ A @ B where the layer has that adapter (a Zamba2 use's low-rank one on a shared product)."""
    y = linear(c, x, name)
    if c.has(f"{adapter}_a.weight"):
        y = c.b.op("Add", y, linear(c, linear(c, x, f"{adapter}_a"), f"{adapter}_b"))
    return y


def _attention(c: Ctx, i: int, h: str, attend: Callable[[int, str], str], rotary: Rotary,
               query_scale: str | None, qkv: str | None = None) -> str:
    """Layer i's attention before its output product: [B, S, H * D] (the output gate applied); qkv: its q, k and v
    where the caller made them (Zamba2's shared blocks)."""
    m, p = c.m, f"layers.{i}"
    if qkv is None:
        qkv = _mla_qkv(c, i, h) if m.mla_kv_rank else linear(c, h, f"{p}.qkv")
    if m.k_eq_v(i):  # (Gemma 4's full layers) q and k from the product, k taken again as v
        q, k = c.b.split(qkv, [m.num_heads * m.head_dim_of(i), m.kv_heads_of(i) * m.head_dim_of(i)])
        qkv = c.b.op("Concat", q, k, k, axis=-1)
    if query_scale is not None and m.scales_queries(i):  # (before the rotation: the same, a rotation being linear)
        if m.shares_kv(i):  # (q alone)
            qkv = c.b.op("Mul", qkv, query_scale)
        else:
            q, kv = c.b.split(qkv, [m.num_heads * m.head_dim_of(i), 2 * m.kv_heads_of(i) * m.head_dim_of(i)])
            qkv = c.b.op("Concat", c.b.op("Mul", q, query_scale), kv, axis=-1)
    if m.qk_norm_after_rope and (table := layer_rope_table(c, i)) is not None:  # (Hunyuan)
        qkv = rotate_packed(c, rotary, qkv, table, i)
    qkv = _qk_norm(c, i, qkv)
    if m.indexed(i) and not m.shares_kv(i):  # (Kolibri 1.1) its keys and values rounded to NVFP4 before they are kept
        q, k, v = c.b.split(qkv, [m.num_heads * m.head_dim_of(i), *[m.kv_heads_of(i) * m.head_dim_of(i)] * 2])
        qkv = c.b.op("Concat", q, nvfp4(c, k), nvfp4(c, v), axis=-1)
    if m.clip_qkv:  # (after q and k's norms: OLMoE)
        qkv = c.b.op("Clip", qkv, c.b.scalar(-m.clip_qkv), c.b.scalar(m.clip_qkv))
    heads = _mla_values(c, i, attend(i, qkv)) if m.mla_kv_rank else attend(i, qkv)
    if m.attn_output_gate:  # (AFMoE: gated per element by the block's input)
        gate = {"sigmoid": "Sigmoid", "softplus": "Softplus"}[m.attn_gate_activation]
        heads = c.b.op("Mul", heads, c.b.op(gate, linear(c, h, f"{p}.attn_gate")))
    if m.sub_norms:  # (BitNet) normed over all its heads before o
        heads = norm(c, heads, f"{p}.attn_sub_norm")
    return heads


def _mixture_of_attention(c: Ctx, i: int, h: str, attend: Callable[[int, str], str], rotary: Rotary,
                          query_scale: str | None) -> str:
    """JetMoE's attention block (ModelSpec.moa_experts): each token's top k experts by the router's logits, weighted
    by their softmax; each expert's q product runs on the tokens that chose it, into their slots, and the slots'
    queries are the attention's heads in the order (kv head, slot) over the shared keys and values; each slot's
    output, times its weight, goes through its expert's o product (on those tokens alone), the bias added once."""
    b, m, p = c.b, c.m, f"layers.{i}"
    k, hkv, d = m.moa_top_k, m.num_kv_heads, m.head_dim
    width = hkv * d
    logits = b.to_float32(linear(c, h, f"{p}.moa_router"))  # [B, S, E]
    top, chosen = b.op_n("TopK", logits, b.ints(k), axis=-1, outputs=2)  # [B, S, k] each, best first
    weights = b.to_compute(b.op("Softmax", top, axis=-1))
    rows = b.op("Reshape", h, b.ints(-1, m.hidden_size))  # [N, hidden]
    picks = [b.op("Transpose", b.op("NonZero", b.op("Equal", b.op("Reshape", chosen, b.ints(-1, k)),
                                                     b.const(np.array(e, np.int64)))), perm=[1, 0])
             for e in range(m.moa_experts)]  # expert e's (token, slot) pairs [n, 2]
    slots = b.zeros(b.op("Concat", b.op("Shape", rows, end=1), b.ints(k, width), axis=0))  # [N, k, Hkv * D]
    for e, pick in enumerate(picks):
        tokens = b.op("Gather", rows, b.op("Gather", pick, b.ints(0), axis=1), axis=0)  # [n, 1, hidden]
        slots = b.op("ScatterND", slots, pick, b.op("Squeeze", linear(c, tokens, f"{p}.moa.{e}.q"), b.ints(1)))
    lead = b.op("Shape", h, end=2)  # [B, S]
    q = b.op("Reshape", b.op("Transpose", b.op("Reshape", slots, b.op("Concat", lead, b.ints(k, hkv, d), axis=0)),
                             perm=[0, 1, 3, 2, 4]), b.ints(0, 0, hkv * k * d))
    qkv = b.op("Concat", q, linear(c, h, f"{p}.kv"), axis=-1)
    heads = _attention(c, i, h, attend, rotary, query_scale, qkv)  # [B, S, Hkv * k * D]
    out = b.op("Transpose", b.op("Reshape", heads, b.ints(0, 0, hkv, k, d)), perm=[0, 1, 3, 2, 4])
    out = b.op("Mul", b.op("Reshape", out, b.ints(0, 0, k, width)), b.unsqueeze(weights, -1))  # [B, S, k, Hkv * D]
    out = b.op("Reshape", out, b.ints(-1, k, width))  # [N, k, Hkv * D]
    acc = b.zeros(b.op("Shape", rows))  # [N, hidden]
    for e, pick in enumerate(picks):  # (a token picks an expert once: each expert adds to a token once)
        y = linear(c, b.op("GatherND", out, pick), f"{p}.moa.{e}.o")  # [n, hidden]
        at = b.op("Gather", pick, b.ints(0), axis=1)  # [n, 1]
        acc = b.op("ScatterND", acc, at, b.op("Add", b.op("GatherND", acc, at), y))
    acc = b.op("Add", acc, b.weight(f"{p}.moa.bias"))
    return b.op("Reshape", acc, b.op("Concat", lead, b.ints(m.hidden_size), axis=0))



def _residual(c: Ctx, x: str, delta: str, next_norm: str | None, fuse: bool,
              last_token: Callable[[str], str] | None = None, scalar: float = 1.0) -> tuple[str, str]:
    """(the next block's input, x + delta): norm(x + delta), or x + delta itself where the next block normalizes
    nothing first (next_norm None: OLMo 2's blocks, OLMo Hybrid's attention ones). `last_token`: the final norm, of
    each row's last token only; `scalar`: x + delta times it first (ModelSpec.layer_scalars)."""
    b = c.b
    if fuse and next_norm is not None and scalar == 1.0:
        h, x = skip_norm(c, x, delta, next_norm)
        return (last_token(h) if last_token else h), x
    x = b.op("Add", x, delta)
    if scalar != 1.0:
        x = b.op("Mul", x, b.scalar(scalar))
    if last_token is not None:
        x = last_token(x)  # [B, 1, Hd]: the final norm and the head see only what generation needs
    if next_norm is None:
        return x, x
    return norm(c, x, next_norm), x


def _block_output(c: Ctx, i: int, y: str, post_norm: str) -> str:
    """Layer i's attention or MLP output as it joins the residual stream: normalized (Gemma, OLMo 2), scaled
    (Granite)."""
    if c.m.layout(i) != "pre":
        y = norm(c, y, post_norm)
    if c.m.residual_scale != 1.0:
        y = c.b.op("Mul", y, c.b.scalar(c.m.residual_scale))
    return y


def _query_scale(c: Ctx) -> str:
    """Each new token's query factor [B, S, 1] (ModelSpec.query_scale_beta: Ministral 3's, Llama 4's), in the compute
    dtype: 1 + beta * log(1 + floor((position + query_scale_offset) / query_scale_after)), 1 below that."""
    b, m = c.b, c.m
    pos = b.cast(io.POSITION_IDS, "float32")
    if m.query_scale_offset:
        pos = b.op("Add", pos, b.const(np.array(m.query_scale_offset, np.float32)))
    steps = b.op("Floor", b.op("Div", pos, b.const(np.array(m.query_scale_after, np.float32))))
    factor = b.op("Add", b.op("Mul", b.op("Log", b.op("Add", steps, b.const(np.array(1.0, np.float32)))),
                              b.const(np.array(m.query_scale_beta, np.float32))), b.const(np.array(1.0, np.float32)))
    return b.to_compute(b.unsqueeze(factor, 2))


def _mla_qkv(c: Ctx, i: int, h: str) -> str:
    """Multi-head latent attention's packed q, k, v (ModelSpec.mla_kv_rank), [B, S, H * D + 2 D] with D = R + C:
    each query head [q_rot, q_nope @ k_up[h]], the one KV head's key [k_rot, norm(latent)] and, as its value, the
    same rows (their first R dims are dropped from the output by _mla_values). q . k is then q_rot . k_rot +
    q_nope . (latent @ k_up[h]^T): the model's score, with the latent cached instead of every head's key and value."""
    b, m, p = c.b, c.m, f"layers.{i}"
    H, C, R, N = m.num_heads, m.mla_kv_rank, m.rotated_dims, m.mla_nope_dim
    q = (linear(c, norm(c, linear(c, h, f"{p}.q_a"), f"{p}.q_a_norm"), f"{p}.q_b") if m.mla_q_rank
         else linear(c, h, f"{p}.q"))
    q_rot, q_nope = b.split(b.op("Reshape", q, b.ints(0, 0, H, R + N)), [R, N])  # [B, S, H, R] / [.., N]
    absorbed = b.op("MatMul", b.unsqueeze(q_nope, 3), b.weight(f"{p}.attn.k_up"))  # [B, S, H, 1, C]
    q = b.op("Reshape", b.op("Concat", q_rot, b.op("Reshape", absorbed, b.ints(0, 0, H, C)), axis=-1),
             b.ints(0, 0, H * (R + C)))
    k_rot, latent = b.split(linear(c, h, f"{p}.kv_a"), [R, C])
    k = b.op("Concat", k_rot, norm(c, latent, f"{p}.kv_a_norm"), axis=-1)  # [B, S, R + C]
    return b.op("Concat", q, k, k, axis=-1)


def _mla_values(c: Ctx, i: int, out: str) -> str:
    """The attention's output [B, S, H * (R + C)] of _mla_qkv's rows: each head's weighted latent times its v_up,
    [B, S, H * V] (what o_proj takes)."""
    b, m = c.b, c.m
    H, C, R = m.num_heads, m.mla_kv_rank, m.rotated_dims
    latent = b.op("Slice", b.op("Reshape", out, b.ints(0, 0, H, R + C)), b.ints(R), b.ints(R + C), b.ints(3))
    values = b.op("MatMul", b.unsqueeze(latent, 3), b.weight(f"layers.{i}.attn.v_up"))  # [B, S, H, 1, V]
    return b.op("Reshape", values, b.ints(0, 0, H * m.mla_v_dim))


def _qk_norm(c: Ctx, i: int, qkv: str) -> str:
    """RMSNorm of q and k before rotary (after it: Hunyuan): over each head (Qwen3, Gemma 3) or over all of q / k
    (OLMo 2); and of v's heads where the model norms them too (Gemma 4)."""
    m = c.m
    if not m.qk_norm or (m.qk_norm_layers and not m.qk_norm_layers[i]):
        return qkv
    b = c.b
    H, Hkv, D = m.num_heads, m.kv_heads_of(i), m.head_dim_of(i)
    if m.shares_kv(i):  # (q alone: the keys and values are another layer's)
        q, k, v = qkv, "", ""
        normed: tuple[tuple[str, int, str], ...] = ((q, H, "q_norm"),)
    else:
        q, k, v = b.split(qkv, [H * D, Hkv * D, Hkv * D])
        normed = ((q, H, "q_norm"), (k, Hkv, "k_norm"), *(((v, Hkv, "v_norm"),) if m.v_norm else ()))
    parts = []
    for x, heads, name in normed:
        if m.qk_norm == "head":
            x4 = b.op("Reshape", x, b.ints(0, 0, heads, D))  # [B, S, heads, D]
            x = b.op("Reshape", norm(c, x4, f"layers.{i}.{name}"), b.ints(0, 0, heads * D))
        else:
            x = norm(c, x, f"layers.{i}.{name}")
        parts.append(x)
    if m.shares_kv(i):
        return parts[0]
    return b.op("Concat", *parts, *(() if m.v_norm else (v,)), axis=-1)


def _activation(c: Ctx, x: str) -> str:
    b = c.b
    if c.m.activation == "silu":
        return b.op("Mul", x, b.op("Sigmoid", x))
    if c.m.activation in ("relu", "relu2"):
        y = b.op("Relu", x)
        return b.op("Mul", y, y) if c.m.activation == "relu2" else y  # relu2: squared (Nemotron)
    if c.m.activation == "gelu":
        erf = b.op("Erf", b.op("Mul", x, b.scalar(1 / math.sqrt(2.0))))
        return b.op("Mul", b.op("Mul", x, b.scalar(0.5)), b.op("Add", erf, b.scalar(1.0)))
    return gelu_tanh(b, x)


def _xielu(c: Ctx, x: str, params: str) -> str:
    """Apertus's xIELU with its layer's [alpha_p, alpha_n, beta, eps]: alpha_p x^2 + beta x where x > 0, else
    (expm1(min(x, eps)) - x) alpha_n + beta x (ONNX has no Expm1: Exp - 1, within ~1e-7 near 0)."""
    b = c.b
    ap, an, beta, eps = b.split(b.to_compute(b.weight(params)), [1, 1, 1, 1], axis=0)
    linear_part = b.op("Mul", x, beta)
    positive = b.op("Add", b.op("Mul", b.op("Mul", x, x), ap), linear_part)
    expm1 = b.op("Sub", b.op("Exp", b.op("Min", x, eps)), b.scalar(1.0))
    negative = b.op("Add", b.op("Mul", b.op("Sub", expm1, x), an), linear_part)
    return b.op("Where", b.op("Greater", x, b.scalar(0.0)), positive, negative)


def _mlp(c: Ctx, i: int, h: str, x: str | None = None) -> str:
    """Layer i's MLP (or mixture) of its normed input h; x: the block's input before its norm (what Gemma 4's
    mixture beside the MLP reads: ModelSpec.moe_beside_mlp)."""
    p = f"layers.{i}"
    if c.m.moe_beside_mlp and c.m.is_moe(i) and x is not None:
        dense = norm(c, _gated_mlp(c, h, p, c.m.intermediate_of(i)), f"{p}.mlp_out_norm")
        experts = moe_mlp(c, i, norm(c, x, f"{p}.router_norm"), experts_in=norm(c, x, f"{p}.moe_in_norm"))
        return c.b.op("Add", dense, norm(c, experts, f"{p}.moe_out_norm"))
    if not c.m.is_moe(i):
        return _plain_mlp(c, h, p) if c.m.family == "gpt2" or c.m.plain_mlp else _gated_mlp(c, h, p,
                                                                                            c.m.intermediate_of(i))
    y = moe_mlp(c, i, h)
    if c.m.shared_expert_size:  # + shared(h), times sigmoid(h @ gate) where gated (Qwen2-MoE); a plain MLP's form
        # where the model's MLPs are plain (Nemotron-H)
        shared = (_plain_mlp(c, h, f"{p}.shared_expert") if c.m.plain_mlp
                  else _gated_mlp(c, h, f"{p}.shared_expert", c.m.shared_expert_size))
        if c.m.shared_expert_gated:
            shared = c.b.op("Mul", c.b.op("Sigmoid", linear(c, h, f"{p}.shared_expert_gate")), shared)
        y = c.b.op("Add", y, shared)
    return norm(c, y, f"{p}.moe_norm") if c.m.moe_post_norm else y  # (A.X K1)


def _plain_mlp(c: Ctx, h: str, p: str) -> str:
    """proj(act(h @ fc)) of the layer named p."""
    inner = linear(c, h, f"{p}.fc")
    act = _xielu(c, inner, f"{p}.{XIELU}") if c.m.activation == "xielu" else _activation(c, inner)
    return linear(c, act, f"{p}.proj")


def _gated_mlp(c: Ctx, h: str, p: str, inner: int) -> str:
    """down(act(h @ gate) * (h @ up)) of the layer named p."""
    if gated_tiles(c, f"{p}.gate_up"):  # one node: silu(h @ gate) * (h @ up)
        return linear(c, gated_product(c, h, f"{p}.gate_up"), f"{p}.down")
    gate, up = c.b.split(linear(c, h, f"{p}.gate_up"), [inner] * 2)
    product = c.b.op("Mul", _activation(c, gate), up)
    if c.m.sub_norms:  # (BitNet) normed before down
        product = norm(c, product, f"{p}.mlp_sub_norm")
    return linear(c, product, f"{p}.down")


def _embed(c: Ctx) -> str:
    """The token embeddings [B, S, Hd]."""
    return _lookup(c, "embed.weight")


def _lookup(c: Ctx, w: str) -> str:
    """The input tokens' rows of table `w` [B, S, width]: a Gather from the fp32 table, or from its exact compact
    form where the engine stores one (quant.compact_table: int8 rows with an fp16 scale per 32, or bfloat16), widened
    after."""
    b = c.b
    if c.has(w + EMBED_Q8):
        q = b.op("Cast", b.op("Gather", b.weight(w + EMBED_Q8), io.INPUT_IDS), to=DTYPES["float32"])
        d = b.op("Cast", b.op("Gather", b.weight(w + EMBED_Q8_SCALES), io.INPUT_IDS), to=DTYPES["float32"])
        lead = b.op("Shape", q, end=-1)  # [B, S]
        blocked = b.op("Reshape", q, b.op("Concat", lead, b.ints(-1, 32), axis=0))
        x = b.op("Reshape", b.op("Mul", blocked, b.unsqueeze(d, -1)), b.op("Concat", lead, b.ints(-1), axis=0))
        return b.to_compute(x)
    if c.has(w + EMBED_BF16):
        rows = b.op("Gather", b.weight(w + EMBED_BF16), io.INPUT_IDS)
        return b.to_compute(b.op("Cast", rows, to=DTYPES["float32"]))
    return b.op("Gather", b.weight(w), io.INPUT_IDS)


def _lm_head(c: Ctx, x: str) -> None:
    """logits = x @ W^T with W [V, Hd] (the embedding when tied: stored once, read transposed by Gemm), then the
    model's logit scaling and soft-cap, in fp32."""
    b, m = c.b, c.m
    packed = any(c.has("lm_head.weight" + suffix) for suffix in (QWEIGHT, Q4TILES, Q8TILES, BF16TILES))
    if packed:
        logits = linear(c, x, "lm_head")  # (+ its bias, where it has one)
    elif c.has("lm_head.part0"):  # row slices of an fp32 head (engines/ort/graphs.py with_head_parts)
        flat_x = b.op("Reshape", x, b.ints(-1, m.hidden_size))
        parts = [b.op("Gemm", flat_x, b.weight(f"lm_head.part{i}"), transB=1)
                 for i in range(sum(1 for k in c.ckpt.weights if k.startswith("lm_head.part")))]
        out_shape = b.op("Concat", b.op("Shape", x, start=0, end=2), b.ints(m.logits_size), axis=0)
        logits = b.op("Reshape", b.op("Concat", *parts, axis=1), out_shape)
    else:
        w = b.weight("embed.weight" if m.tie_embeddings else "lm_head.weight")
        flat = b.op("Gemm", b.op("Reshape", x, b.ints(-1, m.hidden_size)), w, transB=1)  # [B*S, V]
        out_shape = b.op("Concat", b.op("Shape", x, start=0, end=2), b.ints(m.logits_size), axis=0)
        logits = b.op("Reshape", flat, out_shape)
    if c.has("lm_head.bias") and not packed:  # Phi-2
        logits = b.op("Add", logits, b.weight("lm_head.bias"))
    in_f32 = b.dtype == "float32"
    if m.logits_scaling != 1.0 or m.final_softcap:
        logits, in_f32 = b.to_float32(logits), True
        if m.logits_scaling != 1.0:
            logits = b.op("Div", logits, b.const(np.array(m.logits_scaling, np.float32)))
        if m.final_softcap:
            logits = softcap(c, logits, m.final_softcap)
    b.output("Identity" if in_f32 else "Cast", [logits], io.LOGITS, **({} if in_f32 else {"to": DTYPES["float32"]}))
