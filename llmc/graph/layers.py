"""What every part of the decoder graph shares: the build context, linear layers (float, MatMulNBits or llmc's
MatMulQ4 / MatMulQ8) and norms. Shapes in comments: B batch, S new tokens, Hd hidden size."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import helper

from llmc.graph.builder import GraphBuilder
from llmc.graph.checkpoint import Checkpoint
from llmc.graph.io_names import mamba_channels
from llmc.graph.quant import (
    BF16TILES,
    BF16TILES_GATED,
    BLOCKSUM_SCALES,
    BLOCKSUMS,
    OFFSETS,
    QWEIGHT,
    SCALES,
    TILE_BLOCK,
    TILE_OPS,
    QuantSpec,
    bits_of,
)
from llmc.manifest import ModelSpec

MS = "com.microsoft"
LLMC_DOMAIN = "ai.llmc"
CALIBRATE_INPUT = "calibrate.low"  # [layers calibrated] fp32: 1 = that layer at its low precision, 0 = exact
CALIBRATE_POSITIONS = "calibrate.positions"  # [N, 2] int64 (row, position): where a calibration graph's logits go
# A raised LM head's second activation level is computed only for the tiles of 16 logits within this margin of each
# row's largest (MatMulQ4 / MatMulQ8's window, from 2 rows on): a token outside has a probability under e^-8 of the
# top one's, and keeps one int8 level's ~0.04 logit error (on SmolLM2's verify prompts: KL 5e-6 to 2e-5 against the
# two levels' everywhere, the same top token; the two levels over all 3,072 tiles doubled the head's time at batch 8).
HEAD_WINDOW = 8.0


@dataclass(frozen=True)
class GraphOptions:
    attention: str = "decomposed"  # "decomposed" | "gqa" | "llmc" | "onnx" (Attention-24 + TensorScatter, in place)
    quant: QuantSpec | None = None
    fuse_norms: bool = False  # residual Add + norm as ONNX Runtime's Skip*LayerNormalization (not for TensorRT)
    kv_dtype: str = ""  # "llmc" attention: the cache's dtype when it is not the graph's ("float16", "int8")
    paged: bool = False  # "llmc" attention: KV block pools addressed through io_names.BLOCK_TABLE
    key_tiles: bool = False  # "llmc" attention: keys in groups of 16 positions as [D][16] (KVSpec.key_tiles)
    calibrate: tuple[str, ...] = ()  # linear layers at either precision, as CALIBRATE_INPUT says (calibrated)
    resume: bool = False  # calibration: every block but the last an If on resume.CALIBRATE_START (resume.py)
    moe: str = "loop"  # mixture-of-experts lowering (llmc/graph/moe.py): "loop" (standard ops, the picked experts
    # only: the export), "ort" (com.microsoft.MoE: ONNX Runtime engines), "dense" (no control flow: TensorRT)
    llmc_norms: bool = False  # fuse_norms' RMSNorms as llmc's SkipRMSNorm (fp32 graphs with llmc's operators)
    llmc_recurrence: bool = False  # Gated DeltaNet's recurrence as llmc's GatedDeltaRule (graphs with llmc's operators)


@dataclass
class Ctx:
    b: GraphBuilder
    m: ModelSpec
    ckpt: Checkpoint
    opts: GraphOptions
    with_past: bool
    inputs: frozenset[str] = frozenset()  # the graph's input names
    blocks: list[int] = field(default_factory=list)  # where each decoder block's nodes begin (resume.py)

    def has(self, name: str) -> bool:
        return name in self.ckpt.weights


def linear(c: Ctx, x: str, name: str) -> str:
    """x @ W (+ bias); W [K, N] as MatMul, or MatMulNBits / MatMulQ4 / MatMulQ8 when quantized weights are present.
    A layer being calibrated (GraphOptions.calibrate) computes one or the other, as its entry of CALIBRATE_INPUT
    says (calibrated). A decoder layer's input is rounded per token where the model says so (ModelSpec.act_quant:
    BitNet), by llmc's 4- and 8-bit operators themselves (act_rows), else in the graph first (token_int8)."""
    if name in c.opts.calibrate:
        return calibrated(c, x, name)
    w = f"{name}.weight"
    if c.has(w + BF16TILES):
        return matmul_bf16(c, x, name)
    return _product(c, x, name, quantized=c.has(w + QWEIGHT) or _tiles(c, name, gated=False) is not None)


def calibrated(c: Ctx, x: str, name: str) -> str:
    """A calibrated layer's product: an If on its entry of CALIBRATE_INPUT (> 0.5: the low precision), each branch
    the product at one precision over the outer graph's x and weights. A run computes each layer once, at the
    precision it asks for, where a mix of both products (exact + share * (low - exact)) computed every layer both
    ways: 2.2 -> 1.6 s a run of a 0.33 B-parameter model's calibration graph, the same log-probabilities to 3e-6
    (measured, s59)."""
    b = c.b
    share = b.op("Gather", CALIBRATE_INPUT, b.const(np.array(c.opts.calibrate.index(name), np.int64)))
    branches = []
    for quantized in (True, False):
        outer, b.nodes = b.nodes, []
        try:
            out = b.op("Identity", _product(c, x, name, quantized=quantized))  # (the branch's output: its own name)
            body = b.nodes
        finally:
            b.nodes = outer
        branches.append(helper.make_graph(body, f"{name}.{'low' if quantized else 'exact'}", [],
                                          [helper.make_tensor_value_info(out, b.onnx_dtype, None)]))
    return b.op("If", b.op("Greater", share, b.const(np.array(0.5, np.float32))), then_branch=branches[0],
                else_branch=branches[1])


def rounds_input(c: Ctx, name: str) -> bool:
    """The linear layer's input is rounded to int8 per token first (ModelSpec.act_quant "int8_token": BitNet's
    decoder products, not its head)."""
    return c.m.act_quant == "int8_token" and name.startswith("layers.")


def token_int8(c: Ctx, x: str) -> str:
    """x rounded per token to the int8 grid of its largest |x| (ModelSpec.act_quant "int8_token": BitNet b1.58's
    activation quantization), in fp32: round(x s) / s with s = 127 / max(max |x|, 1e-5); |x s| <= 127, so the
    grid needs no clamp."""
    b = c.b
    xf = b.to_float32(x)
    peak = b.op("Max", b.reduce_max(b.op("Abs", xf), -1), b.const(np.array(1e-5, np.float32)))
    s = b.op("Div", b.const(np.array(127.0, np.float32)), peak)
    return b.to_compute(b.op("Div", b.op("Round", b.op("Mul", xf, s)), s))


def _product(c: Ctx, x: str, name: str, quantized: bool) -> str:
    b, w = c.b, f"{name}.weight"
    if quantized and _tiles(c, name, gated=False) is not None:
        return matmul_tiles(c, x, name, gated=False)
    if rounds_input(c, name):
        x = token_int8(c, x)
    if quantized:
        q = c.opts.quant
        assert q is not None, f"{w} is quantized but no QuantSpec was given"
        qweight = c.ckpt.weights[w + QWEIGHT]
        if c.has(w + BLOCKSUMS):  # "folded": x extended with its block sums feeds the offset rows
            sums = c.ckpt.weights[w + BLOCKSUMS]
            x = b.op("Concat", x, _matmul_nbits(c, x, w + BLOCKSUMS, w + BLOCKSUM_SCALES, sums, 4), axis=-1)
        y = _matmul_nbits(c, x, w + QWEIGHT, w + SCALES, qweight, bits_of(qweight, q.block_size))
        if c.has(w + OFFSETS):  # the "minmax" scheme's per-block offsets, as an fp32 MatMul of the block sums
            blocks = qweight.shape[1]
            lead = b.op("Shape", x, end=-1)  # [B, S] (or [N] in a mixture's expert)
            blocked = b.op("Reshape", x, b.op("Concat", lead, b.ints(blocks, q.block_size), axis=0))
            block_sums = b.op("ReduceSum", blocked, b.ints(-1), keepdims=0)  # [..., K / block]
            y = b.op("Add", y, b.op("MatMul", block_sums, b.weight(w + OFFSETS)))
    else:
        y = b.op("MatMul", x, b.weight(w))
    return b.op("Add", y, b.weight(f"{name}.bias")) if c.has(f"{name}.bias") else y


def _out_width(m: ModelSpec, name: str) -> int:
    """A linear layer's output width (its packed tiles are padded to 32 columns)."""
    kind = name.rsplit(".", 1)[-1]
    layer = int(name.split(".")[1]) if name.startswith("layers.") else 0  # (per-layer widths: Gemma 4)
    inner = (m.moe_intermediate_size if ".experts." in name else m.shared_expert_size if ".shared_expert." in name
             else m.intermediate_of(layer))
    mla_q = m.num_heads * (m.rotated_dims + m.mla_nope_dim)  # (latent attention's q products: decoder._mla_qkv)
    # (a layer reading another's cache: q alone; one whose values are its keys: q and k)
    own_kv = 0 if m.shares_kv(layer) else (1 if m.k_eq_v(layer) else 2) * m.kv_heads_of(layer)
    widths = {"qkv": (m.num_heads + own_kv) * m.head_dim_of(layer), "gate_up": 2 * inner,
              "fc": inner, "up": inner, "lm_head": m.logits_size, "o": m.hidden_size, "q": mla_q, "q_b": mla_q,
              "q_a": m.mla_q_rank, "kv_a": m.head_dim, "attn_gate": m.num_heads * m.head_dim_of(layer),
              "conv_in": 3 * m.hidden_size,
              "lin_in": 2 * (m.linear_k_heads * m.linear_k_dim + m.linear_v_heads * (m.linear_v_dim + 1)),
              "mamba_in": (m.mamba_heads * m.mamba_head_dim + mamba_channels(m)  # (z or x; the convolved
                           + (m.mamba_heads if m.mamba_version == 2 else 0)),  # channels; Mamba-2's dt)
              "kda_in": m.linear_v_heads * (3 * m.linear_v_dim + 1) + 2 * m.linear_v_dim,
              "kda_f": m.linear_v_heads * m.linear_v_dim, "kda_g": m.linear_v_heads * m.linear_v_dim,
              "mamba_x": m.mamba_dt_rank + 2 * m.mamba_state, "mamba_dt": m.mamba_heads * m.mamba_head_dim,
              "moe_latent_in": m.moe_latent_size, "ple_proj": m.num_layers * m.per_layer_input_size,
              "ple_gate": m.per_layer_input_size, "moa_router": m.moa_experts,
              "kv": 2 * m.num_kv_heads * m.head_dim}
    if ".moa." in name:  # (a mixture of attention's expert: its queries, Hkv heads, or its output product)
        return m.num_kv_heads * m.head_dim if kind == "q" else m.hidden_size
    if kind == "down" and ".experts." in name and m.moe_latent_size:  # (latent experts: their outputs are L wide)
        return m.moe_latent_size
    return widths.get(kind, m.hidden_size)  # down, proj, moe_latent_out, ple_out


def gelu_tanh(b: GraphBuilder, x: str) -> str:
    """GELU's tanh approximation (gelu_new, gelu_pytorch_tanh): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    cube = b.op("Mul", b.op("Mul", x, x), x)
    inner = b.op("Mul", b.op("Add", x, b.op("Mul", cube, b.scalar(0.044715))), b.scalar(math.sqrt(2 / math.pi)))
    return b.op("Mul", b.op("Mul", x, b.scalar(0.5)), b.op("Add", b.op("Tanh", inner), b.scalar(1.0)))


def gated_tiles(c: Ctx, name: str) -> bool:
    """Whether a SwiGLU gate/up layer is stored in a gated form of llmc's tiles (2-, 4-, 8-bit or bf16)."""
    return c.has(f"{name}.weight" + BF16TILES_GATED) or _tiles(c, name, gated=True) is not None


def _tiles(c: Ctx, name: str, gated: bool) -> str | None:
    """The suffix of the layer's weights in llmc's integer tiles (quant.TILE_OPS), or None."""
    return next((s + "_gated" * gated for s in TILE_OPS if c.has(f"{name}.weight" + s + "_gated" * gated)), None)


def gated_product(c: Ctx, x: str, name: str) -> str:
    """silu(x @ gate) * (x @ up) in one node, from a gate/up layer in llmc's gated tiles (gated_tiles)."""
    if c.has(f"{name}.weight" + BF16TILES_GATED):
        return matmul_bf16(c, x, name, gated=True)
    return matmul_tiles(c, x, name, gated=True)


def head_window(m: ModelSpec) -> float:
    """The margin of a raised head's second level (HEAD_WINDOW) in its outputs' units, before the logits are divided
    by the model's scaling; 0 (everywhere) under a final soft-cap, which can squeeze any gap of the outputs into less
    than the margin."""
    return 0.0 if m.final_softcap or m.logits_scaling <= 0 else HEAD_WINDOW * m.logits_scaling


def matmul_tiles(c: Ctx, x: str, name: str, gated: bool) -> str:
    """ai.llmc.MatMulQ4 / MatMulQ8 / MatMulQ2 over the packed 4-, 8- or 2-bit tiles, the bias inside; gated:
    silu(x @ gate) * (x @ up)."""
    suffix = _tiles(c, name, gated)
    assert suffix is not None, f"{name} has no integer tiles"
    b, w, op = c.b, f"{name}.weight" + suffix, TILE_OPS[suffix.removesuffix("_gated")]
    _, rows, _ = c.ckpt.weights[w].shape
    blocks = rows - (op == "MatMulQ2")  # (its first row: the columns' scales and mins)
    bias = f"{name}.bias"
    n = _out_width(c.m, name)
    q = c.opts.quant
    act_bits = q.act_bits_of(name) if q is not None else 8
    attrs: dict[str, Any] = {"act_bits": act_bits} if act_bits != 8 else {}
    if rounds_input(c, name):  # (BitNet) each row on its own int8 grid: the model's own integers (two levels would
        # add nothing to an input that is int8)
        attrs = {"act_rows": 1}
    if c.opts.calibrate:  # a calibration graph scores decode's arithmetic, whose rows are int8 (not the prompts')
        attrs["int8_prompts"] = 1
    elif name == "lm_head" and act_bits == 16 and head_window(c.m):
        attrs["window"] = head_window(c.m)
    return b.op(op, x, b.weight(w), *([b.weight(bias)] if c.has(bias) else []),
                domain=LLMC_DOMAIN, K=blocks * TILE_BLOCK, N=n, gated=int(gated), **attrs)


def matmul_bf16(c: Ctx, x: str, name: str, gated: bool = False) -> str:
    """ai.llmc.MatMulBF16 over the packed bf16 tiles (fp32 activations rounded to bf16, fp32 sums), the bias inside;
    gated: silu(x @ gate) * (x @ up)."""
    b, w = c.b, f"{name}.weight" + (BF16TILES_GATED if gated else BF16TILES)
    _, pairs, _ = c.ckpt.weights[w].shape
    if rounds_input(c, name):
        x = token_int8(c, x)
    bias = f"{name}.bias"
    attrs = {"gated": 1} if gated else {}
    return b.op("MatMulBF16", x, b.weight(w), *([b.weight(bias)] if c.has(bias) else []), domain=LLMC_DOMAIN,
                K=2 * pairs, N=_out_width(c.m, name), **attrs)


def _matmul_nbits(c: Ctx, x: str, qname: str, sname: str, qweight: np.ndarray, bits: int) -> str:
    q = c.opts.quant
    assert q is not None
    n, blocks, _ = qweight.shape
    layer = qname.split(".weight")[0]
    two_level = q.precision_of(layer) == "int8-act16"
    y = c.b.op("MatMulNBits", _two_levels(c, x, blocks, q.block_size) if two_level else x, c.b.weight(qname),
               c.b.weight(sname), domain=MS, K=blocks * q.block_size, N=n, bits=bits, block_size=q.block_size,
               accuracy_level=q.accuracy_of(layer))
    return c.b.op("ReduceSum", y, c.b.ints(0), keepdims=0) if two_level else y


def _two_levels(c: Ctx, x: str, blocks: int, block: int) -> str:
    """x [..., K] as [2, ..., K]: x1 = s1 round(x / s1), s1 = max|x| / 127 per block of `block` along K, and the
    same of x - x1. MatMulNBits at accuracy_level 4 quantizes its input per block the same way, so each level
    passes through exactly and the sum of the two products is x @ W to about 1e-5 (one level: ~5e-3), the weights
    read once (a product of twice the rows)."""
    b = c.b
    shape = b.op("Shape", x)
    blocked = b.op("Reshape", x, b.op("Concat", b.op("Shape", x, end=-1), b.ints(blocks, block), axis=0))

    def level(v: str) -> str:
        scale = b.op("Max", b.op("Div", b.reduce_max(b.op("Abs", v), -1), b.scalar(127.0)),
                     b.scalar(1e-30 if b.dtype == "float32" else 1e-7))  # a block of zeros: scale > 0
        return b.op("Mul", b.op("Round", b.op("Div", v, scale)), scale)

    first = level(blocked)
    second = level(b.op("Sub", blocked, first))
    return b.op("Concat", *(b.unsqueeze(b.op("Reshape", v, shape), 0) for v in (first, second)), axis=0)


def norm(c: Ctx, x: str, name: str, eps: float = 0.0, groups: int = 1) -> str:
    """RMSNorm / LayerNorm over the last axis, always accumulated in fp32 (fp16 overflows here); eps 0: the
    model's; groups > 1 (RMSNorm of x [B, S, C]): over each of that many equal groups of the channels (a Mamba-2
    mixer's gated norm)."""
    b = c.b
    eps = eps or c.m.norm_eps
    xf = b.to_float32(x)
    w = b.to_float32(b.weight(f"{name}.weight"))
    if groups > 1:
        shape = b.op("Shape", x)
        xf, w = b.op("Reshape", xf, b.ints(0, 0, groups, -1)), b.op("Reshape", w, b.ints(groups, -1))
        return b.op("Reshape", _rms(c, xf, w, eps), shape)
    if c.m.norm == "layer":
        bias = b.to_float32(b.weight(f"{name}.bias"))
        y = b.op("LayerNormalization", xf, w, bias, axis=-1, epsilon=eps)
    else:
        y = _rms(c, xf, w, eps)
    return b.to_compute(y)


def _rms(c: Ctx, xf: str, w: str, eps: float) -> str:
    """RMSNorm of fp32 xf over its last axis, times w."""
    b = c.b
    var = b.reduce_mean(b.op("Pow", xf, b.const(np.array(2.0, np.float32))), -1)
    denom = b.op("Sqrt", b.op("Add", var, b.const(np.array(eps, np.float32))))
    return b.op("Mul", b.op("Div", xf, denom), w)


def skip_norm(c: Ctx, x: str, delta: str, name: str) -> tuple[str, str]:
    """ONNX Runtime's Skip(Simplified)LayerNormalization, or llmc's SkipRMSNorm (GraphOptions.llmc_norms): (norm(x +
    delta), x + delta) in one node."""
    b = c.b
    out = b._name("SkipNorm")
    inputs = [x, delta, b.weight(f"{name}.weight")]
    if c.opts.llmc_norms and c.m.norm != "layer":
        b.nodes.append(helper.make_node("SkipRMSNorm", inputs, [f"{out}_norm", f"{out}_sum"], name=out,
                                        domain=LLMC_DOMAIN, epsilon=c.m.norm_eps))
        return f"{out}_norm", f"{out}_sum"
    if c.m.norm == "layer":
        op, inputs = "SkipLayerNormalization", [*inputs, b.weight(f"{name}.bias")]
    else:
        op = "SkipSimplifiedLayerNormalization"
    b.nodes.append(helper.make_node(op, inputs, [f"{out}_norm", "", "", f"{out}_sum"], name=out, domain=MS,
                                    epsilon=c.m.norm_eps))
    return f"{out}_norm", f"{out}_sum"


def softcap(c: Ctx, x: str, cap: float) -> str:
    """cap * tanh(x / cap) of an fp32 tensor (Gemma 2's score and logit soft-capping)."""
    value = c.b.const(np.array(cap, dtype=np.float32))
    return c.b.op("Mul", c.b.op("Tanh", c.b.op("Div", x, value)), value)
