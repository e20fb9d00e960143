"""The decoder written directly as ONNX: prefill and decode-with-past graphs.

No tracing of transformers' modeling code (and its cache classes): every node is placed here, so the graphs stay
the same across transformers versions and the parity tests decide whether they are right.
Three attention lowerings share everything else: "decomposed" (standard ONNX ops, concat KV: the portable export),
"gqa" (ONNX Runtime's GroupQueryAttention over one [B, Hkv, max_len, D] buffer bound as past and present: the KV
cache is written in place), "llmc" (the same contract as "gqa", computed by llmc's own ONNX Runtime operator
`ai.llmc.CachedAttention`, which reads each cached key and value once for all query heads of its KV head and takes
an fp16 or int8 cache) and "onnx" (opset-24 TensorScatter writes the new K/V into that buffer in place and the
standard Attention op reads it: in place with standard ops only, what TensorRT >= 10.15 parses). Linear layers become
MatMulNBits when their weights were quantized, or llmc's own ai.llmc.MatMulQ4 when they were packed for it (the
SwiGLU MLP's gate and up projections then one node with the gate applied).
Shapes in comments: B batch, S new tokens, P past length, T = P + S, H/Hkv heads, G = H // Hkv, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from llmc.graph import io_names as io
from llmc.graph.builder import DTYPES, NP_DTYPES, GraphBuilder
from llmc.graph.checkpoint import INV_FREQ, Checkpoint
from llmc.graph.quant import (
    BLOCKSUM_SCALES,
    BLOCKSUMS,
    OFFSETS,
    Q4TILES,
    Q4TILES_GATED,
    QWEIGHT,
    SCALES,
    TILE_BLOCK,
    QuantSpec,
    bits_of,
)
from llmc.manifest import GraphSpec, ModelSpec

MS = "com.microsoft"
LLMC_DOMAIN = "ai.llmc"


@dataclass(frozen=True)
class GraphOptions:
    attention: str = "decomposed"  # "decomposed" | "gqa" | "llmc" | "onnx" (Attention-24 + TensorScatter, in place)
    quant: QuantSpec | None = None
    fuse_norms: bool = False  # residual Add + norm as ONNX Runtime's Skip*LayerNormalization (not for TensorRT)
    kv_dtype: str = ""  # "llmc" attention: the cache's dtype when it is not the graph's ("float16", "int8")


@dataclass
class _Ctx:
    b: GraphBuilder
    m: ModelSpec
    ckpt: Checkpoint
    opts: GraphOptions
    with_past: bool

    def has(self, name: str) -> bool:
        return name in self.ckpt.weights


def build_graph(ckpt: Checkpoint, spec: GraphSpec, dtype: str, opset: int,
                opts: GraphOptions | None = None) -> tuple[onnx.GraphProto, list[str]]:
    """Build one graph (prefill when it has no past inputs); returns it and the weight names it uses."""
    opts = opts or GraphOptions()
    names = set(spec.input_names())
    c = _Ctx(GraphBuilder(opset, dtype), ckpt.spec, ckpt, opts, with_past=io.PAST_KEY.format(i=0) in names
             and opts.attention == "decomposed")
    b, m = c.b, c.m
    x = b.op("Gather", b.weight("embed.weight"), io.INPUT_IDS)  # [B, S, Hd]
    if m.positions == "learned":
        x = b.op("Add", x, b.op("Gather", b.weight("pos_embed.weight"), io.POSITION_IDS))
    lowerings: dict[str, type[_DecomposedAttention | _GroupQueryAttention]] = {
        "decomposed": _DecomposedAttention, "gqa": _GroupQueryAttention, "llmc": _CachedAttention,
        "onnx": _OnnxAttention}
    attend = lowerings[opts.attention](c)
    if not opts.fuse_norms:  # standard ops only: residual Add, then the norm
        for i in range(m.num_layers):
            p = f"layers.{i}"
            h = _norm(c, x, f"{p}.norm1")
            x = b.op("Add", x, _linear(c, attend(i, _linear(c, h, f"{p}.qkv")), f"{p}.o"))
            h = _norm(c, x, f"{p}.norm2")
            x = b.op("Add", x, _mlp(c, p, h))
        if spec.logits == "last":
            x = attend.last_token(x)  # [B, 1, Hd]
        _lm_head(c, _norm(c, x, "norm"))
    else:  # ONNX Runtime: each residual Add fused with the norm after it
        h = _norm(c, x, "layers.0.norm1")
        for i in range(m.num_layers):
            p = f"layers.{i}"
            h, x = _skip_norm(c, x, _linear(c, attend(i, _linear(c, h, f"{p}.qkv")), f"{p}.o"), f"{p}.norm2")
            after = f"layers.{i + 1}.norm1" if i + 1 < m.num_layers else "norm"
            h, x = _skip_norm(c, x, _mlp(c, p, h), after)
        _lm_head(c, attend.last_token(h) if spec.logits == "last" else h)
    graph = helper.make_graph(b.nodes, spec.file.removesuffix(".onnx"), [_value_info(t) for t in spec.inputs],
                              [_value_info(t) for t in spec.outputs], initializer=list(b.constants.values()))
    return graph, b.weights_used


def _value_info(t: object) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, DTYPES[t.dtype], list(t.shape))  # type: ignore[attr-defined]


def _linear(c: _Ctx, x: str, name: str) -> str:
    """x @ W (+ bias); W [K, N] as MatMul, or MatMulNBits when quantized weights are present."""
    b, w = c.b, f"{name}.weight"
    if c.has(w + Q4TILES):
        return _matmul_q4(c, x, name, gated=False)
    if c.has(w + QWEIGHT):
        q = c.opts.quant
        assert q is not None, f"{w} is quantized but no QuantSpec was given"
        qweight = c.ckpt.weights[w + QWEIGHT]
        if c.has(w + BLOCKSUMS):  # "folded": x extended with its block sums feeds the offset rows
            sums = c.ckpt.weights[w + BLOCKSUMS]
            x = b.op("Concat", x, _matmul_nbits(c, x, w + BLOCKSUMS, w + BLOCKSUM_SCALES, sums, 4), axis=-1)
        y = _matmul_nbits(c, x, w + QWEIGHT, w + SCALES, qweight, bits_of(qweight, q.block_size))
        if c.has(w + OFFSETS):  # the "minmax" scheme's per-block offsets, as an fp32 MatMul of the block sums
            blocks = qweight.shape[1]
            block_sums = b.op("ReduceSum", b.op("Reshape", x, b.ints(0, 0, blocks, q.block_size)), b.ints(-1),
                              keepdims=0)  # [B, S, K / block]
            y = b.op("Add", y, b.op("MatMul", block_sums, b.weight(w + OFFSETS)))
    else:
        y = b.op("MatMul", x, b.weight(w))
    return b.op("Add", y, b.weight(f"{name}.bias")) if c.has(f"{name}.bias") else y


def _out_width(m: ModelSpec, name: str) -> int:
    """A linear layer's output width (its packed tiles are padded to 32 columns)."""
    kind = name.rsplit(".", 1)[-1]
    widths = {"qkv": (m.num_heads + 2 * m.num_kv_heads) * m.head_dim, "gate_up": 2 * m.intermediate_size,
              "fc": m.intermediate_size, "lm_head": m.vocab_size}
    return widths.get(kind, m.hidden_size)  # o, down, proj


def _matmul_q4(c: _Ctx, x: str, name: str, gated: bool) -> str:
    """ai.llmc.MatMulQ4 over the packed 4-bit tiles, the bias inside; gated: silu(x @ gate) * (x @ up)."""
    b, w = c.b, f"{name}.weight" + (Q4TILES_GATED if gated else Q4TILES)
    _, blocks, _ = c.ckpt.weights[w].shape
    bias = f"{name}.bias"
    n = _out_width(c.m, name)
    return b.op("MatMulQ4", x, b.weight(w), *([b.weight(bias)] if c.has(bias) else []), domain=LLMC_DOMAIN,
                K=blocks * TILE_BLOCK, N=n, gated=int(gated))


def _matmul_nbits(c: _Ctx, x: str, qname: str, sname: str, qweight: np.ndarray, bits: int) -> str:
    q = c.opts.quant
    assert q is not None
    n, blocks, _ = qweight.shape
    return c.b.op("MatMulNBits", x, c.b.weight(qname), c.b.weight(sname), domain=MS, K=blocks * q.block_size, N=n,
                  bits=bits, block_size=q.block_size, accuracy_level=q.accuracy_level)


def _norm(c: _Ctx, x: str, name: str) -> str:
    """RMSNorm / LayerNorm, always accumulated in fp32 (fp16 overflows here)."""
    b = c.b
    xf = b.to_float32(x)
    w = b.to_float32(b.weight(f"{name}.weight"))
    if c.m.norm == "layer":
        bias = b.to_float32(b.weight(f"{name}.bias"))
        y = b.op("LayerNormalization", xf, w, bias, axis=-1, epsilon=c.m.norm_eps)
    else:
        var = b.reduce_mean(b.op("Pow", xf, b.const(np.array(2.0, np.float32))), -1)
        denom = b.op("Sqrt", b.op("Add", var, b.const(np.array(c.m.norm_eps, np.float32))))
        y = b.op("Mul", b.op("Div", xf, denom), w)
    return b.to_compute(y)


def _skip_norm(c: _Ctx, x: str, delta: str, name: str) -> tuple[str, str]:
    """ONNX Runtime's Skip(Simplified)LayerNormalization: (norm(x + delta), x + delta) in one node."""
    b = c.b
    out = b._name("SkipNorm")
    inputs = [x, delta, b.weight(f"{name}.weight")]
    if c.m.norm == "layer":
        op, inputs = "SkipLayerNormalization", [*inputs, b.weight(f"{name}.bias")]
    else:
        op = "SkipSimplifiedLayerNormalization"
    b.nodes.append(helper.make_node(op, inputs, [f"{out}_norm", "", "", f"{out}_sum"], name=out, domain=MS,
                                    epsilon=c.m.norm_eps))
    return f"{out}_norm", f"{out}_sum"


def _activation(c: _Ctx, x: str) -> str:
    b = c.b
    if c.m.activation == "silu":
        return b.op("Mul", x, b.op("Sigmoid", x))
    if c.m.activation == "gelu":
        erf = b.op("Erf", b.op("Mul", x, b.scalar(1 / math.sqrt(2.0))))
        return b.op("Mul", b.op("Mul", x, b.scalar(0.5)), b.op("Add", erf, b.scalar(1.0)))
    # tanh approximation (gelu_new): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    cube = b.op("Mul", b.op("Mul", x, x), x)
    inner = b.op("Mul", b.op("Add", x, b.op("Mul", cube, b.scalar(0.044715))), b.scalar(math.sqrt(2 / math.pi)))
    return b.op("Mul", b.op("Mul", x, b.scalar(0.5)), b.op("Add", b.op("Tanh", inner), b.scalar(1.0)))


def _mlp(c: _Ctx, p: str, h: str) -> str:
    if c.m.family == "gpt2":
        return _linear(c, _activation(c, _linear(c, h, f"{p}.fc")), f"{p}.proj")
    if c.has(f"{p}.gate_up.weight" + Q4TILES_GATED):  # one node: silu(h @ gate) * (h @ up)
        return _linear(c, _matmul_q4(c, h, f"{p}.gate_up", gated=True), f"{p}.down")
    gate, up = c.b.split(_linear(c, h, f"{p}.gate_up"), [c.m.intermediate_size] * 2)
    return _linear(c, c.b.op("Mul", _activation(c, gate), up), f"{p}.down")


def _lm_head(c: _Ctx, x: str) -> None:
    """logits = x @ W^T with W [V, Hd] (the embedding when tied: stored once, read transposed by Gemm)."""
    b, m = c.b, c.m
    if c.has("lm_head.weight" + QWEIGHT) or c.has("lm_head.weight" + Q4TILES):
        logits = _linear(c, x, "lm_head")
    else:
        w = b.weight("embed.weight" if m.tie_embeddings else "lm_head.weight")
        flat = b.op("Gemm", b.op("Reshape", x, b.ints(-1, m.hidden_size)), w, transB=1)  # [B*S, V]
        out_shape = b.op("Concat", b.op("Shape", x, start=0, end=2), b.ints(m.vocab_size), axis=0)
        logits = b.op("Reshape", flat, out_shape)
    b.output("Identity" if b.dtype == "float32" else "Cast", [logits], io.LOGITS,
             **({} if b.dtype == "float32" else {"to": DTYPES["float32"]}))


class _DecomposedAttention:
    """Standard ONNX ops; past [B, Hkv, P, D] and the new K/V concatenated into present [B, Hkv, T, D]."""

    def __init__(self, c: _Ctx) -> None:
        self.c = c
        self.allowed = self._allowed()
        self.rope = self._rope_tables() if c.m.positions == "rope" else None

    def _allowed(self) -> str:
        """[B, 1, 1, S, T] bool: key t is visible to new token s iff t <= P + s and attention_mask[b, t] == 1."""
        b = self.c.b
        zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
        t, s = b.op("Squeeze", b.dim(io.ATTENTION_MASK, 1)), b.op("Squeeze", b.dim(io.INPUT_IDS, 1))
        key_idx = b.op("Range", zero, t, one)  # [T]
        query_idx = b.op("Range", b.op("Sub", t, s), t, one)  # [S]
        causal = b.op("LessOrEqual", b.unsqueeze(key_idx, 0), b.unsqueeze(query_idx, 1))  # [S, T]
        valid = b.unsqueeze(b.cast(io.ATTENTION_MASK, "bool"), 1)  # [B, 1, T]
        return b.unsqueeze(b.op("And", causal, valid), 1, 2)  # [B, 1, 1, S, T]

    def _rope_tables(self) -> tuple[str, str]:
        """cos, sin [B, 1, S, D] computed in fp32 from position_ids, as transformers does."""
        b = self.c.b
        pos = b.unsqueeze(b.cast(io.POSITION_IDS, "float32"), 2)
        freqs = b.op("Mul", pos, b.weight(INV_FREQ))  # [B, S, D/2]
        emb = b.op("Concat", freqs, freqs, axis=-1)  # [B, S, D]
        scale = self.c.m.rope_attention_scaling
        tables = []
        for fn in ("Cos", "Sin"):
            t = b.op(fn, emb)
            if scale != 1.0:
                t = b.op("Mul", t, b.const(np.array(scale, np.float32)))
            tables.append(b.unsqueeze(b.to_compute(t), 1))
        return tables[0], tables[1]

    def _rotate(self, x: str) -> str:
        b, (cos, sin), half = self.c.b, self.rope, self.c.m.head_dim // 2  # type: ignore[misc]
        x1, x2 = b.split(x, [half, half])
        rotated = b.op("Concat", b.op("Neg", x2), x1, axis=-1)
        return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))

    def _heads(self, x: str, heads: int) -> str:
        """[B, S, heads*D] -> [B, heads, S, D]"""
        b = self.c.b
        return b.op("Transpose", b.op("Reshape", x, b.ints(0, 0, heads, self.c.m.head_dim)), perm=[0, 2, 1, 3])

    def _split_heads(self, qkv: str) -> tuple[str, str, str]:
        """Packed [B, S, (H + 2 Hkv) D] -> q [B, H, S, D], k, v [B, Hkv, S, D], rotary applied to q and k."""
        m = self.c.m
        H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
        q, k, v = self.c.b.split(qkv, [H * D, Hkv * D, Hkv * D])
        q, k, v = self._heads(q, H), self._heads(k, Hkv), self._heads(v, Hkv)
        if self.rope is not None:
            q, k = self._rotate(q), self._rotate(k)
        return q, k, v

    def __call__(self, i: int, qkv: str) -> str:
        b, m = self.c.b, self.c.m
        H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
        q, k, v = self._split_heads(qkv)
        present = (io.PRESENT_KEY.format(i=i), io.PRESENT_VALUE.format(i=i))
        if self.c.with_past:
            k = b.output("Concat", [io.PAST_KEY.format(i=i), k], present[0], axis=2)  # [B, Hkv, T, D]
            v = b.output("Concat", [io.PAST_VALUE.format(i=i), v], present[1], axis=2)
        else:
            k, v = b.output("Identity", [k], present[0]), b.output("Identity", [v], present[1])
        # Grouped heads without copying K/V: q as [B, Hkv, G, S, D] against K/V broadcast as [B, Hkv, 1, T, D].
        q5 = b.op("Mul", b.op("Reshape", q, b.ints(0, Hkv, H // Hkv, -1, D)), b.scalar(1.0 / math.sqrt(D)))
        k_t = b.op("Transpose", b.unsqueeze(k, 2), perm=[0, 1, 2, 4, 3])  # [B, Hkv, 1, D, T]
        scores = b.to_float32(b.op("MatMul", q5, k_t))  # [B, Hkv, G, S, T], softmax in fp32
        scores = b.op("Where", self.allowed, scores, b.const(np.array(np.finfo(np.float32).min, np.float32)))
        probs = b.to_compute(b.op("Softmax", scores, axis=-1))
        out = b.op("MatMul", probs, b.unsqueeze(v, 2))  # [B, Hkv, G, S, D]
        out = b.op("Transpose", b.op("Reshape", out, b.ints(0, H, -1, D)), perm=[0, 2, 1, 3])  # [B, S, H, D]
        return b.op("Reshape", out, b.ints(0, 0, H * D))

    def last_token(self, x: str) -> str:
        """Hidden state of each row's last valid token (right or left padding): [B, S, Hd] -> [B, 1, Hd]."""
        b = self.c.b
        one = b.const(np.array(1, np.int64))
        s = b.op("Squeeze", b.dim(io.ATTENTION_MASK, 1))
        ranks = b.op("Range", one, b.op("Add", s, one), one)  # [S]: 1..S
        last = b.op("ArgMax", b.op("Mul", io.ATTENTION_MASK, ranks), axis=1, keepdims=1)  # [B, 1]
        return b.unsqueeze(b.op("GatherND", x, last, batch_dims=1), 1)


class _GroupQueryAttention:
    """com.microsoft.GroupQueryAttention: packed QKV in, rotary inside, K/V written into the shared buffer.

    seqlens_k[b] = tokens of row b after this step - 1; total_sequence_length = max over rows + 1.
    """

    def __init__(self, c: _Ctx) -> None:
        self.c = c
        b, m = c.b, c.m
        self.rope: tuple[str, str] | None = None
        if m.positions == "rope":
            inv_freq = c.ckpt.weights[INV_FREQ].astype(np.float64)
            freqs = np.outer(np.arange(m.max_positions, dtype=np.float64), inv_freq).astype(np.float32)
            scale, dtype = np.float32(m.rope_attention_scaling), NP_DTYPES[b.dtype]  # caches in the qkv dtype
            self.rope = (b.const((np.cos(freqs) * scale).astype(dtype)),
                         b.const((np.sin(freqs) * scale).astype(dtype)))  # [max_pos, D/2]

    def __call__(self, i: int, qkv: str) -> str:
        b, m = self.c.b, self.c.m
        rope = self.rope or ("", "")
        past = (io.PAST_KEY.format(i=i), io.PAST_VALUE.format(i=i))
        present = [io.PRESENT_KEY.format(i=i), io.PRESENT_VALUE.format(i=i)]
        out = b._name("GroupQueryAttention") + "_out"
        b.nodes.append(helper.make_node(
            "GroupQueryAttention", [qkv, "", "", *past, io.SEQLENS_K, io.TOTAL_SEQ_LEN, *rope],
            [out, *present], name=out.removesuffix("_out"), domain=MS, num_heads=m.num_heads,
            kv_num_heads=m.num_kv_heads, scale=1.0 / math.sqrt(m.head_dim), do_rotary=int(self.rope is not None),
            rotary_interleaved=0))
        return out

    def last_token(self, x: str) -> str:
        """Row b's last new token: [B, S, Hd] -> [B, 1, Hd]. It is at index seqlens_k[b] of a right-padded prompt
        (empty past), and at S - 1 when the row has a past: a one-token decode row, or one row's prompt chunk."""
        b = self.c.b
        last_col = b.op("Sub", b.op("Squeeze", b.dim(io.INPUT_IDS, 1)), b.const(np.array(1, np.int64)))
        last = b.unsqueeze(b.op("Min", b.cast(io.SEQLENS_K, "int64"), last_col), 1)  # [B, 1]
        return b.unsqueeze(b.op("GatherND", x, last, batch_dims=1), 1)


class _CachedAttention(_GroupQueryAttention):
    """ai.llmc.CachedAttention (llmc/engines/kernels): GroupQueryAttention's inputs, outputs and semantics, without
    its unused key/value inputs; the cache may be fp16, or int8 rows with their scale, while Q/K/V stay fp32."""

    def __call__(self, i: int, qkv: str) -> str:
        b, m = self.c.b, self.c.m
        rope = self.rope or ()
        past = (io.PAST_KEY.format(i=i), io.PAST_VALUE.format(i=i))
        present = [io.PRESENT_KEY.format(i=i), io.PRESENT_VALUE.format(i=i)]
        op = {"float16": "CachedAttentionF16Cache", "int8": "CachedAttentionI8Cache"}.get(self.c.opts.kv_dtype,
                                                                                          "CachedAttention")
        out = b._name(op) + "_out"
        b.nodes.append(helper.make_node(
            op, [qkv, *past, io.SEQLENS_K, io.TOTAL_SEQ_LEN, *rope], [out, *present],
            name=out.removesuffix("_out"), domain=LLMC_DOMAIN, num_heads=m.num_heads, kv_num_heads=m.num_kv_heads,
            scale=1.0 / math.sqrt(m.head_dim)))
        return out


class _OnnxAttention(_DecomposedAttention):
    """Opset 24: TensorScatter writes the new K/V at each row's position into the bound [B, Hkv, max_len, D] buffer
    (past and present share it); Attention reads the first T = max(position) + 1 positions under a causal mask."""

    def __init__(self, c: _Ctx) -> None:
        self.c = c
        b = c.b
        self.rope = self._rope_tables() if c.m.positions == "rope" else None
        pos = io.POSITION_IDS  # [B, S]: each new token's position; row b writes at pos[b, 0]
        self.write_index = b.op("Squeeze", b.op("Gather", pos, b.ints(0), axis=1), b.ints(1))  # [B]
        one = b.const(np.array(1, np.int64))
        self.total = b.op("Add", b.op("ReduceMax", pos, keepdims=0), one)  # []
        keys = b.op("Range", b.const(np.array(0, np.int64)), self.total, one)  # [T]
        allowed = b.op("LessOrEqual", b.unsqueeze(keys, 0, 1), b.unsqueeze(pos, 2))  # [B, S, T]
        self.mask = b.unsqueeze(allowed, 1)  # [B, 1, S, T]

    def __call__(self, i: int, qkv: str) -> str:
        b, m = self.c.b, self.c.m
        H, D = m.num_heads, m.head_dim
        q, k, v = self._split_heads(qkv)
        zero = b.ints(0)
        used = []
        for new, past, present in ((k, io.PAST_KEY, io.PRESENT_KEY), (v, io.PAST_VALUE, io.PRESENT_VALUE)):
            full = b.output("TensorScatter", [past.format(i=i), new, self.write_index], present.format(i=i), axis=2)
            used.append(b.op("Slice", full, zero, b.unsqueeze(self.total, 0), b.ints(2)))  # [B, Hkv, T, D]
        out = b.op("Attention", q, used[0], used[1], self.mask, scale=1.0 / math.sqrt(D))  # [B, H, S, D]
        return b.op("Reshape", b.op("Transpose", out, perm=[0, 2, 1, 3]), b.ints(0, 0, H * D))

    def last_token(self, x: str) -> str:
        """Row b's last token is where its position is largest (right padding pads with position 0)."""
        b = self.c.b
        last = b.op("ArgMax", io.POSITION_IDS, axis=1, keepdims=1)  # [B, 1]
        return b.unsqueeze(b.op("GatherND", x, last, batch_dims=1), 1)
