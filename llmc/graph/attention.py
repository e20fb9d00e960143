"""Attention lowerings and rotary embeddings. Every lowering computes the same thing per layer: the layer's own rotary
table (or none: NoPE layers), partial rotary, its sliding window, the model's score scale and softcap.

"decomposed": standard ONNX ops over a concatenated cache (the portable export). "gqa": ONNX Runtime's
GroupQueryAttention over one [B, Hkv, max_len, D] buffer bound as past and present. "llmc": the same contract
computed by llmc's own operator (ai.llmc.CachedAttention; fp16 or int8 caches). "onnx": opset-24 TensorScatter writes
the new K/V into that buffer in place and the standard Attention op reads it (what TensorRT parses). "onnx-static":
the same write, and Attention over the whole fixed-size buffer under a [B, 1, S, max_seq] mask, so no shape depends
on the data (TensorRT's native attention: a fused kernel and CUDA-graph capture).
Shapes: B batch, S new tokens, P past, T = P + S, H / Hkv heads, G = H // Hkv, D head dim, R rotated dims.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import helper

from llmc.graph import io_names as io
from llmc.graph.builder import NP_DTYPES
from llmc.graph.checkpoint import INV_FREQ, INV_FREQ_LOCAL, INV_FREQ_LONG
from llmc.graph.layers import LLMC_DOMAIN, MS, Ctx, softcap

_NEG = np.finfo(np.float32).min


SINKS = "layers.{i}.attn.sinks"  # [H] (ModelSpec.attn_sinks)


def sinks(c: Ctx, layer: int) -> str | None:
    """The layer's attention sinks [H] (GPT-OSS: one more logit each query head's softmax takes, whose value is 0),
    or None."""
    return c.b.weight(SINKS.format(i=layer)) if c.m.attn_sinks else None


def _with_sink_column(c: Ctx, scores: str, layer: int, shape: list[int]) -> str:
    """scores [..., T] (fp32, masked) with the layer's sink logits as one more column, T + 1; `shape` reshapes the
    [H] sinks to broadcast against scores' leading axes."""
    b = c.b
    sink = b.op("Reshape", b.to_float32(b.weight(SINKS.format(i=layer))), b.ints(*shape))
    column = b.op("Expand", sink, b.op("Concat", b.op("Shape", scores, end=-1), b.ints(1), axis=0))
    return b.op("Concat", scores, column, axis=-1)


def _without_sink_column(c: Ctx, probs: str) -> str:
    """The softmax's weights of the keys: its last column (the sink's) dropped."""
    b = c.b
    return b.op("Slice", probs, b.ints(0), b.ints(-1), b.ints(-1))


def layer_rope_table(c: Ctx, layer: int) -> str | None:
    """The rotary table a layer uses: none (NoPE), the sliding layers' local one (Gemma 3), or the global one."""
    if not c.m.has_rope(layer):
        return None
    return INV_FREQ_LOCAL if c.m.window(layer) and c.has(INV_FREQ_LOCAL) else INV_FREQ


def rope_table(c: Ctx, layer: int) -> str | None:
    """The rotary table the attention applies: the layer's, or none where the decoder rotated q and k before their
    norms (ModelSpec.qk_norm_after_rope)."""
    return None if c.m.qk_norm_after_rope else layer_rope_table(c, layer)


def _table_scaling(c: Ctx, table: str) -> float:
    return c.m.rope_local_attention_scaling if table == INV_FREQ_LOCAL else c.m.rope_attention_scaling


class Rotary:
    """cos / sin of this graph's tokens, computed in fp32 from position_ids as transformers does, and rotation.

    Tables are [B, S, R] (rotate-half form), unsqueezed for [B, heads, S, D] (axis 1) or [B, S, heads, D] (axis 2).
    longrope: a row whose largest position is at or past `rope_long_after` uses the long-factor table (as
    transformers decides per forward call, here per row, so a batch gives what each row gives alone).
    """

    def __init__(self, c: Ctx) -> None:
        self.c = c
        self._tables: dict[tuple[str, int], tuple[str, str]] = {}
        self._long_rows: str | None = None

    def tables(self, table: str, axis: int) -> tuple[str, str]:
        key = (table, axis)
        if key not in self._tables:
            cos, sin = self._compute(table)
            if table == INV_FREQ and self.c.m.rope_long_after:
                long_cos, long_sin = self._compute(INV_FREQ_LONG)
                rows = self._long_row_mask()
                cos, sin = self.c.b.op("Where", rows, long_cos, cos), self.c.b.op("Where", rows, long_sin, sin)
            b = self.c.b
            self._tables[key] = (b.unsqueeze(cos, axis), b.unsqueeze(sin, axis))
        return self._tables[key]

    def _compute(self, table: str) -> tuple[str, str]:
        b = self.c.b
        pos = b.unsqueeze(b.cast(io.POSITION_IDS, "float32"), 2)  # [B, S, 1]
        freqs = b.op("Mul", pos, b.weight(table))  # [B, S, R/2]
        emb = b.op("Concat", freqs, freqs, axis=-1)  # [B, S, R]
        scale = _table_scaling(self.c, table)
        out = []
        for fn in ("Cos", "Sin"):
            t = b.op(fn, emb)
            if scale != 1.0:
                t = b.op("Mul", t, b.const(np.array(scale, np.float32)))
            out.append(b.to_compute(t))
        return out[0], out[1]

    def _long_row_mask(self) -> str:
        """[B, 1, 1] bool: the row's largest position + 1 passes rope_long_after."""
        if self._long_rows is None:
            b = self.c.b
            row_max = b.reduce_max(io.POSITION_IDS, 1)  # [B, 1]
            limit = b.const(np.array(self.c.m.rope_long_after - 1, np.int64))
            self._long_rows = b.unsqueeze(b.op("Greater", row_max, limit), 2)
        return self._long_rows

    def rotate(self, x: str, cos: str, sin: str, layer: int) -> str:
        """Rotate the first R dims of each head of x (layer `layer`'s, rotate-half), pass the rest through."""
        b, m = self.c.b, self.c.m
        r, d = m.rotated_dims_of(layer), m.head_dim_of(layer)
        rot, rest = (b.split(x, [r, d - r]) if r < d else (x, None))
        x1, x2 = b.split(rot, [r // 2, r // 2])
        rotated = b.op("Add", b.op("Mul", rot, cos), b.op("Mul", b.op("Concat", b.op("Neg", x2), x1, axis=-1), sin))
        return rotated if rest is None else b.op("Concat", rotated, rest, axis=-1)


def rotate_packed(c: Ctx, rotary: Rotary, qkv: str, table: str, layer: int) -> str:
    """Layer `layer`'s packed [B, S, (H + 2 Hkv) D] with q and k rotated in the graph (for lowerings whose op cannot
    rotate)."""
    b, m = c.b, c.m
    H, Hkv, D = m.num_heads, m.kv_heads_of(layer), m.head_dim_of(layer)
    cos, sin = rotary.tables(table, 2)
    if m.shares_kv(layer):  # (q alone)
        x4 = b.op("Reshape", qkv, b.ints(0, 0, H, D))
        return b.op("Reshape", rotary.rotate(x4, cos, sin, layer), b.ints(0, 0, H * D))
    q, k, v = b.split(qkv, [H * D, Hkv * D, Hkv * D])
    parts = []
    for x, heads in ((q, H), (k, Hkv)):
        x4 = b.op("Reshape", x, b.ints(0, 0, heads, D))  # [B, S, heads, D]
        parts.append(b.op("Reshape", rotary.rotate(x4, cos, sin, layer), b.ints(0, 0, heads * D)))
    return b.op("Concat", *parts, v, axis=-1)


def nvfp4(c: Ctx, x: str) -> str:
    """x [..., n * 16] rounded to NVFP4 and back, as Kolibri 1.1's module does it (ModelSpec.index_layers): in each 16
    consecutive values, an E4M3 scale max |x| / 6 (clamped to [2^-9, 448], rounded to nearest even: 3 mantissa bits,
    2^-9 steps below 2^-6), each value over it an E2M1 magnitude (steps of 0.5 below 2, 1 below 4, 2 up to 6, nearest
    even), in fp32. The scale's rounding is arithmetic (a float8 Cast needs opset 19)."""
    b = c.b
    f = b.to_float32(x)
    lead = b.op("Shape", f, end=-1)
    blocks = b.op("Reshape", f, b.op("Concat", lead, b.ints(-1, 16), axis=0))  # [..., n, 16]
    two = b.const(np.array(2.0, np.float32))
    s = b.op("Div", b.reduce_max(b.op("Abs", blocks), -1), b.const(np.array(6.0, np.float32)))
    s = b.op("Clip", s, b.const(np.array(2.0 ** -9, np.float32)), b.const(np.array(448.0, np.float32)))
    e = b.op("Floor", b.op("Mul", b.op("Log", s), b.const(np.array(1 / np.log(2.0), np.float32))))
    one = b.const(np.array(1.0, np.float32))
    # (the logarithm's rounding corrected: 2^e <= s < 2^(e + 1) exactly)
    e = b.op("Sub", e, b.op("Cast", b.op("Greater", b.op("Pow", two, e), s), to=1))
    e = b.op("Add", e, b.op("Cast", b.op("LessOrEqual", b.op("Pow", two, b.op("Add", e, one)), s), to=1))
    step = b.op("Pow", two, b.op("Sub", b.op("Max", e, b.const(np.array(-6.0, np.float32))),
                                 b.const(np.array(3.0, np.float32))))
    s = b.op("Mul", b.op("Round", b.op("Div", s, step)), step)
    scaled = b.op("Div", blocks, s)
    mag = b.op("Min", b.op("Abs", scaled), b.const(np.array(6.0, np.float32)))
    half = b.const(np.array(0.5, np.float32))
    grid = b.op("Where", b.op("Less", mag, two), half,
                b.op("Where", b.op("Less", mag, b.const(np.array(4.0, np.float32))), one, two))
    rounded = b.op("Mul", b.op("Round", b.op("Div", mag, grid)), grid)
    out = b.op("Mul", b.op("Mul", rounded, b.op("Sign", scaled)), s)
    return b.to_compute(b.op("Reshape", out, b.op("Shape", f)))


def index_selection(c: Ctx, i: int, q: str, k: str, allowed: str, qpos: str, kpos: str) -> str:
    """[B, S, T] bool: `allowed` [B, S, T] narrowed, for indexed layer i's queries that see more than index_budget
    keys, to their first index_sink keys, their last index_local and the index_topk others of highest routing score
    (ModelSpec.index_layers: sum over the first index_heads query heads of relu(nvfp4(q_h) . k[t]), KV head 0's keys
    as cached, already NVFP4; ties: TopK's, the earlier key). q [B, H, S, D], k [B, Hkv, T, D]; qpos [B, S, 1] and
    kpos [B or 1, 1, T] int64: the queries' and keys' positions."""
    b, m = c.b, c.m
    heads = b.op("Slice", q, b.ints(0), b.ints(m.index_heads), b.ints(1))  # [B, n, S, D]
    key0 = b.op("Slice", k, b.ints(0), b.ints(1), b.ints(1))  # [B, 1, T, D]
    scores = b.op("MatMul", b.to_float32(nvfp4(c, heads)),
                  b.op("Transpose", b.to_float32(key0), perm=[0, 1, 3, 2]))  # [B, n, S, T]
    scores = b.op("ReduceSum", b.op("Relu", scores), b.ints(1), keepdims=0)  # [B, S, T]

    def count(n: int) -> str:
        return b.const(np.array(n, np.int64))

    length = b.op("Add", qpos, count(1))  # [B, S, 1]: the keys up to the query's
    sinks = b.op("Less", kpos, count(m.index_sink))
    local = b.op("GreaterOrEqual", kpos, b.op("Sub", length, count(m.index_local)))
    candidates = b.op("And", allowed, b.op("And", b.op("Not", sinks), b.op("Not", local)))
    ranked = b.op("Where", candidates, scores, b.const(np.array(-np.inf, np.float32)))
    top = b.op("Min", b.op("Shape", ranked, start=-1), b.ints(m.index_topk))
    _, chosen = b.op_n("TopK", ranked, top, axis=-1, outputs=2)  # [B, S, min(topk, T)]
    picked = b.op("ScatterElements", b.op("ConstantOfShape", b.op("Shape", ranked)),
                  chosen, b.op("ConstantOfShape", b.op("Shape", chosen),
                               value=helper.make_tensor("one", 1, [1], [1.0])), axis=-1)
    selected = b.op("Or", b.op("And", b.cast(picked, "bool"), candidates), b.op("Or", sinks, local))
    long = b.op("Greater", length, count(m.index_budget))  # [B, S, 1]
    return b.op("And", allowed, b.op("Or", b.op("Not", long), selected))


def _inside(b: Any, keys: str, pos: str, window: int, chunk: int) -> str:
    """Keys at positions `keys` inside the window W (t > p - W) or the chunk C (t // C == p // C) of queries at
    `pos` (int64, broadcast against each other)."""
    if window:
        return b.op("Greater", keys, b.op("Sub", pos, b.const(np.array(window, np.int64))))
    size = b.const(np.array(chunk, np.int64))  # (non-negative positions: Div truncates as floor)
    return b.op("Equal", b.op("Div", keys, size), b.op("Div", pos, size))


class DecomposedAttention:
    """Standard ONNX ops; past [B, Hkv, P, D] and the new K/V concatenated into present [B, Hkv, T, D]. A layer
    that reads another layer's cache (ModelSpec.kv_sources) attends the keys and values that layer attended."""

    def __init__(self, c: Ctx) -> None:
        self.c = c
        self.rotary = Rotary(c)
        self._masks: dict[tuple[int, int], str] = {}
        self.attended_kv: dict[int, tuple[str, str]] = {}  # layer -> the K and V it attended (for layers sharing them)

    def allowed(self, window: int, chunk: int = 0) -> str:
        """[B, 1, 1, S, T] bool: key t is visible to new token s iff t <= P + s, attention_mask[b, t] == 1 and, with
        a window W, the key's position is within the query's last W, with a chunk C in the query's block of C
        (positions count the row's valid keys, so a right-padded row's windows are its own)."""
        if (window, chunk) not in self._masks:
            b = self.c.b
            zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
            t, s = b.op("Squeeze", b.dim(io.ATTENTION_MASK, 1)), b.op("Squeeze", b.dim(io.INPUT_IDS, 1))
            key_idx = b.op("Range", zero, t, one)  # [T]
            query_idx = b.op("Range", b.op("Sub", t, s), t, one)  # [S]
            causal = b.op("LessOrEqual", b.unsqueeze(key_idx, 0), b.unsqueeze(query_idx, 1))  # [S, T]
            valid = b.unsqueeze(b.cast(io.ATTENTION_MASK, "bool"), 1)  # [B, 1, T]
            allowed = b.op("And", causal, valid)  # [B, S, T]
            if window or chunk:
                key_pos = b.op("Sub", b.op("CumSum", io.ATTENTION_MASK, b.const(np.array(1, np.int64))), one)
                allowed = b.op("And", allowed, _inside(b, b.unsqueeze(key_pos, 1), b.unsqueeze(io.POSITION_IDS, 2),
                                                       window, chunk))  # [B, S, T]
            self._masks[window, chunk] = b.unsqueeze(allowed, 1, 2)  # [B, 1, 1, S, T]
        return self._masks[window, chunk]

    def _heads(self, x: str, heads: int, dim: int) -> str:
        """[B, S, heads*D] -> [B, heads, S, D]"""
        b = self.c.b
        return b.op("Transpose", b.op("Reshape", x, b.ints(0, 0, heads, dim)), perm=[0, 2, 1, 3])

    def split_heads(self, i: int, qkv: str) -> tuple[str, str | None, str | None]:
        """Packed [B, S, (H + 2 Hkv) D] -> q [B, H, S, D], k, v [B, Hkv, S, D], the layer's rotary applied (q alone
        and no k, v for a layer reading another's cache)."""
        m = self.c.m
        H, Hkv, D = m.num_heads, m.kv_heads_of(i), m.head_dim_of(i)
        k: str | None = None
        v: str | None = None
        if m.shares_kv(i):
            q = self._heads(qkv, H, D)
        else:
            q, k_new, v_new = self.c.b.split(qkv, [H * D, Hkv * D, Hkv * D])
            q, k, v = self._heads(q, H, D), self._heads(k_new, Hkv, D), self._heads(v_new, Hkv, D)
        table = rope_table(self.c, i)
        if table is not None:
            cos, sin = self.rotary.tables(table, 1)
            q = self.rotary.rotate(q, cos, sin, i)
            k = None if k is None else self.rotary.rotate(k, cos, sin, i)
        return q, k, v

    def __call__(self, i: int, qkv: str) -> str:
        b, m = self.c.b, self.c.m
        q, k, v = self.split_heads(i, qkv)
        if k is None or v is None:  # (the source layer's, as it attended them)
            k, v = self.attended_kv[m.kv_source(i)]
        else:
            present, past = io.layer_kv(m, i, "present"), io.layer_kv(m, i, "past")
            if self.c.with_past:
                k = b.output("Concat", [past[0], k], present[0], axis=2)  # [B, Hkv, T, D]
                v = b.output("Concat", [past[1], v], present[1], axis=2)
            else:
                k, v = b.output("Identity", [k], present[0]), b.output("Identity", [v], present[1])
            self.attended_kv[i] = (k, v)
        allowed = self.allowed(m.window(i), m.chunk(i))
        if m.indexed(i):  # (positions count the row's valid keys, as the windows')
            b1 = b.const(np.array(1, np.int64))
            key_pos = b.op("Sub", b.op("CumSum", io.ATTENTION_MASK, b1), b1)  # [B, T]
            allowed = b.unsqueeze(index_selection(self.c, i, q, k, b.op("Squeeze", allowed, b.ints(1, 2)),
                                                  b.unsqueeze(io.POSITION_IDS, 2), b.unsqueeze(key_pos, 1)), 1, 2)
        return self.grouped(i, q, k, v, allowed)

    def grouped(self, i: int, q: str, k: str, v: str, allowed: str) -> str:
        """Layer i's attention of q [B, H, S, D] over k, v [B, Hkv, T, D] where `allowed` [B, 1, 1, S, T] (bool):
        [B, S, H * D]."""
        b, m = self.c.b, self.c.m
        H, Hkv, D = m.num_heads, m.kv_heads_of(i), m.head_dim_of(i)
        # Grouped heads without copying K/V: q as [B, Hkv, G, S, D] against K/V broadcast as [B, Hkv, 1, T, D].
        q5 = b.op("Mul", b.op("Reshape", q, b.ints(0, Hkv, H // Hkv, -1, D)), b.scalar(m.scale_of(i)))
        k_t = b.op("Transpose", b.unsqueeze(k, 2), perm=[0, 1, 2, 4, 3])  # [B, Hkv, 1, D, T]
        scores = b.to_float32(b.op("MatMul", q5, k_t))  # [B, Hkv, G, S, T], softmax in fp32
        if m.attn_softcap:
            scores = softcap(self.c, scores, m.attn_softcap)
        scores = b.op("Where", allowed, scores, b.const(np.array(_NEG, np.float32)))
        if m.attn_sinks:
            probs = _without_sink_column(self.c, b.op("Softmax", _with_sink_column(self.c, scores, i,
                                                                                  [1, Hkv, H // Hkv, 1, 1]), axis=-1))
        else:
            probs = b.op("Softmax", scores, axis=-1)
        out = b.op("MatMul", b.to_compute(probs), b.unsqueeze(v, 2))  # [B, Hkv, G, S, D]
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


class GroupQueryAttention:
    """com.microsoft.GroupQueryAttention: packed QKV in, rotary inside (unless the graph rotates: longrope, or a
    partial rotary the op cannot do), K/V written into the shared buffer; local_window_size = W, softcap.

    seqlens_k[b] = tokens of row b after this step - 1; total_sequence_length = max over rows + 1.
    """

    op_type = "GroupQueryAttention"
    domain = MS

    def __init__(self, c: Ctx) -> None:
        self.c = c
        self.in_graph = io.rotary_in_graph(c.m, c.opts.attention)
        self.rotary = Rotary(c)
        self._caches: dict[str, tuple[str, str]] = {}
        self._reader: OnnxAttention | None = None

    def caches(self, table: str) -> tuple[str, str]:
        """cos / sin caches [max_pos, R/2] of a table, in the qkv dtype."""
        if table not in self._caches:
            b, m = self.c.b, self.c.m
            inv_freq = self.c.ckpt.weights[table].astype(np.float64)
            freqs = np.outer(np.arange(m.max_positions, dtype=np.float64), inv_freq).astype(np.float32)
            scale, dtype = np.float32(_table_scaling(self.c, table)), NP_DTYPES[b.dtype]
            self._caches[table] = (b.const((np.cos(freqs) * scale).astype(dtype)),
                                   b.const((np.sin(freqs) * scale).astype(dtype)))
        return self._caches[table]

    def _rope(self, i: int, qkv: str) -> tuple[str, tuple[str, ...]]:
        """(qkv, rotary inputs of the op): rotated here when the op cannot, else the op's cos / sin caches."""
        table = rope_table(self.c, i)
        if table is None:
            return qkv, ()
        if self.in_graph:
            return rotate_packed(self.c, self.rotary, qkv, table, i), ()
        return qkv, self.caches(table)

    def _attrs(self, i: int) -> dict[str, Any]:
        m = self.c.m
        attrs: dict[str, Any] = {"num_heads": m.num_heads, "kv_num_heads": m.kv_heads_of(i), "scale": m.scale_of(i)}
        if m.window(i):
            attrs["local_window_size"] = m.window(i)
        if m.chunk(i):  # (llmc's operator; GroupQueryAttention has none: its __call__ refuses the layer)
            attrs["attention_chunk_size"] = m.chunk(i)
        if m.attn_softcap:
            attrs["softcap"] = m.attn_softcap
        return attrs

    def _node(self, op: str, layer: int, inputs: list[str], attrs: dict[str, Any], domain: str) -> str:
        b = self.c.b
        name = b._name(op)
        present = io.layer_kv(self.c.m, layer, "present")
        b.nodes.append(helper.make_node(op, inputs, [f"{name}_out", *present], name=name, domain=domain, **attrs))
        return f"{name}_out"

    def __call__(self, i: int, qkv: str) -> str:
        if self.c.m.chunk(i):
            raise ValueError("GroupQueryAttention has no chunked attention (Llama 4's): the llmc, onnx or decomposed "
                             "lowering builds it")
        if self.c.m.shares_kv(i):
            return self._read_shared(i, qkv)
        if self.c.m.indexed(i):  # (the op writes the keys and values, its attention without the key selection
            # unused: the graph's reads what it wrote)
            self._write_only(i, qkv)
            return self._read_shared(i, qkv)
        qkv, rope = self._rope(i, qkv)
        past = io.layer_kv(self.c.m, i, "past")
        inputs = [qkv, "", "", *past, io.SEQLENS_K, io.TOTAL_SEQ_LEN, *(rope or ("", ""))]
        sink = sinks(self.c, i)
        if sink is not None:  # head_sink, after position_ids and attention_bias (unused)
            inputs += ["", "", sink]
        attrs = {**self._attrs(i), "do_rotary": int(bool(rope)), "rotary_interleaved": 0}
        return self._node(self.op_type, i, inputs, attrs, self.domain)

    def _write_only(self, i: int, qkv: str) -> str:
        """The op writing layer i's keys and values (its own attention output unused): an indexed layer's, whose
        attention the graph computes (_read_shared)."""
        past = io.layer_kv(self.c.m, i, "past")
        return self._node(self.op_type, i, [qkv, "", "", *past, io.SEQLENS_K, io.TOTAL_SEQ_LEN], self._attrs(i),
                          self.domain)

    def _read_shared(self, i: int, q: str) -> str:
        """A layer reading another layer's cache (ModelSpec.kv_sources; q alone), or an indexed layer its own (its
        qkv, written), in standard ops: q rotated in the graph, over the buffer as its node wrote it this run (its
        present output), the first max(position) + 1 positions under a mask by position (a row's key t sits at its
        position t: the in-place layout), and an indexed layer's key selection."""
        if self._reader is None:
            self._reader = OnnxAttention(self.c)
        reader, b = self._reader, self.c.b
        q4, _, _ = reader.split_heads(i, q)
        k, v = (reader.attended(name, b.ints(0)) for name in io.layer_kv(self.c.m, i, "present"))
        allowed = reader.allowed(self.c.m.window(i), self.c.m.chunk(i))  # [B, 1, S, T]
        if self.c.m.indexed(i):
            allowed = b.unsqueeze(reader.selection(i, q4, k, b.op("Squeeze", allowed, b.ints(1))), 1)
        return reader.grouped(i, q4, k, v, b.unsqueeze(allowed, 2))  # [B, 1, 1, S, T]

    def last_token(self, x: str) -> str:
        """Row b's last new token: [B, S, Hd] -> [B, 1, Hd]. It is at index seqlens_k[b] of a right-padded prompt
        (empty past), and at S - 1 when the row has a past: a one-token decode row, or one row's prompt chunk."""
        b = self.c.b
        last_col = b.op("Sub", b.op("Squeeze", b.dim(io.INPUT_IDS, 1)), b.const(np.array(1, np.int64)))
        last = b.unsqueeze(b.op("Min", b.cast(io.SEQLENS_K, "int64"), last_col), 1)  # [B, 1]
        return b.unsqueeze(b.op("GatherND", x, last, batch_dims=1), 1)


class CachedAttention(GroupQueryAttention):
    """ai.llmc.CachedAttention (llmc/engines/kernels): GroupQueryAttention's inputs, outputs and semantics, without
    its unused key/value inputs; the cache may be fp16, or int8 rows with their scale, while Q/K/V stay fp32."""

    # the layers reading another's cache run on each row's last token alone (decoder._layers' narrow): one new token
    # a row, at its last position (seqlens_k), whatever the run's width
    shared_last_only = False

    def reads_last_tokens_only(self) -> bool:
        """Whether this graph's layers reading another's cache can take each row's last token alone: they are the
        last layers that attend, the operator rotates their queries from seqlens_k (no table in the graph), and
        nothing else in them reads the run's positions (per-position query scales, states)."""
        m = self.c.m
        sharers = [i for i in range(m.num_layers) if m.shares_kv(i)]
        # (and no layer after the first of them writes a cache, which every token feeds: Kolibri 1.1's interleave)
        return (bool(sharers) and all(m.shares_kv(i) or not m.attends(i) for i in range(sharers[0], m.num_layers))
                and not self.in_graph and not m.query_scale_beta and not m.has_states)

    def __call__(self, i: int, qkv: str) -> str:
        qkv, rope = self._rope(i, qkv)
        shared = self.c.m.shares_kv(i)  # (its source layer's cache as that layer's node left it: read only)
        past = io.layer_kv(self.c.m, i, "present" if shared else "past")
        op = {"float16": "CachedAttentionF16Cache", "int8": "CachedAttentionI8Cache"}.get(self.c.opts.kv_dtype,
                                                                                          "CachedAttention")
        inputs = [qkv, *past, io.SEQLENS_K, io.TOTAL_SEQ_LEN, *rope]
        if self.c.opts.paged:  # rows of different counts after a past run together (new_tokens; a narrowed
            # shared layer's rows have one each)
            inputs = [*inputs, *[""] * (2 - len(rope)), io.BLOCK_TABLE,
                      "" if shared and self.shared_last_only else io.NEW_TOKENS]
        sink = sinks(self.c, i)
        if sink is not None:  # input 9, fp32 as the op computes
            inputs = [*inputs, *[""] * (9 - len(inputs)), self.c.b.to_float32(sink)]
        attrs = {**self._attrs(i), **({"key_tiles": 1} if self.c.opts.key_tiles else {})}
        m = self.c.m
        if m.indexed(i):  # (Kolibri 1.1) each query's keys chosen past the budget, inside the operator
            attrs.update(index_topk=m.index_topk, index_local=m.index_local, index_sink=m.index_sink,
                         index_heads=m.index_heads)
        if shared:
            return self.c.b.op(op, *inputs, domain=LLMC_DOMAIN, kv_shared=1, **attrs)
        return self._node(op, i, inputs, attrs, LLMC_DOMAIN)

    def last_token(self, x: str) -> str:
        """Paged graphs: row b's last new token is at new_tokens[b] - 1 (any row, past or not); otherwise as
        GroupQueryAttention's."""
        if not self.c.opts.paged:
            return super().last_token(x)
        b = self.c.b
        last = b.unsqueeze(b.op("Sub", b.cast(io.NEW_TOKENS, "int64"), b.const(np.array(1, np.int64))), 1)
        return b.unsqueeze(b.op("GatherND", x, last, batch_dims=1), 1)


class OnnxAttention(DecomposedAttention):
    """Opset 24: TensorScatter writes the new K/V at each row's position into the bound [B, Hkv, max_len, D] buffer
    (past and present share it); Attention reads the first T = max(position) + 1 positions under a causal (and,
    for sliding layers, windowed) mask."""

    def __init__(self, c: Ctx) -> None:
        super().__init__(c)
        b = c.b
        one = b.const(np.array(1, np.int64))
        self.total = b.op("Add", b.op("ReduceMax", io.POSITION_IDS, keepdims=0), one)  # []
        self.keys = b.op("Range", b.const(np.array(0, np.int64)), self.total, one)  # [T]
        self._write_index: str | None = None

    @property
    def write_index(self) -> str:
        """[B]: where row b writes its new K/V, pos[b, 0] (position_ids [B, S]: each new token's position)."""
        if self._write_index is None:
            b = self.c.b
            self._write_index = b.op("Squeeze", b.op("Gather", io.POSITION_IDS, b.ints(0), axis=1), b.ints(1))
        return self._write_index

    def allowed(self, window: int, chunk: int = 0) -> str:
        """[B, 1, S, T]: key t is visible to a query at position p iff t <= p and, with a window W, t > p - W, with a
        chunk C, t // C == p // C."""
        if (window, chunk) not in self._masks:
            b = self.c.b
            keys, pos = b.unsqueeze(self.keys, 0, 1), b.unsqueeze(io.POSITION_IDS, 2)  # [1, 1, T], [B, S, 1]
            allowed = b.op("LessOrEqual", keys, pos)  # [B, S, T]
            if window or chunk:
                allowed = b.op("And", allowed, _inside(b, keys, pos, window, chunk))
            self._masks[window, chunk] = b.unsqueeze(allowed, 1)
        return self._masks[window, chunk]

    def __call__(self, i: int, qkv: str) -> str:
        b, m = self.c.b, self.c.m
        H, D = m.num_heads, m.head_dim_of(i)
        q, k, v = self.split_heads(i, qkv)
        zero = b.ints(0)
        used = []
        if k is None or v is None:  # (a layer reading another's cache: what that layer attended)
            used = list(self.attended_kv[m.kv_source(i)])
        else:
            for new, past, present in zip((k, v), io.layer_kv(m, i, "past"), io.layer_kv(m, i, "present")):
                full = b.output("TensorScatter", [past, new, self.write_index], present, axis=2)
                used.append(self.attended(full, zero))
            self.attended_kv[i] = (used[0], used[1])
        attrs: dict[str, Any] = {"scale": m.scale_of(i)}
        if m.attn_softcap:
            attrs["softcap"] = m.attn_softcap
        mask = self.allowed(m.window(i), m.chunk(i))
        if m.indexed(i):
            mask = b.unsqueeze(self.selection(i, q, used[0], b.op("Squeeze", mask, b.ints(1))), 1)
        if m.attn_sinks:
            used, mask = self._sink_key(i, used, mask)
        out = b.op("Attention", q, used[0], used[1], mask, **attrs)  # [B, H, S, D]
        return b.op("Reshape", b.op("Transpose", out, perm=[0, 2, 1, 3]), b.ints(0, 0, H * D))

    def selection(self, i: int, q: str, k: str, allowed: str) -> str:
        """index_selection over the buffer's keys (key t at position t: the in-place layout), [B, S, T]."""
        b = self.c.b
        return index_selection(self.c, i, q, k, allowed, b.unsqueeze(io.POSITION_IDS, 2), b.unsqueeze(self.keys, 0, 1))

    def _sink_key(self, i: int, used: list[str], mask: str) -> tuple[list[str], str]:
        """Attention has no sinks: one more key and value of zeros after the T read, and a float mask [B, H, S, T + 1]
        that adds each head's sink to that key's score (0) and keeps the others' (0 where allowed, far below
        otherwise). A copy of the keys and values read, each step: models with sinks are faster on the other
        attentions."""
        b, m = self.c.b, self.c.m
        k = used[0]
        shape = b.op("Concat", b.op("Shape", k, end=2), b.ints(1), b.op("Shape", k, start=3), axis=0)  # [B, Hkv, 1, D]
        zero = b.op("CastLike", b.op("ConstantOfShape", shape), k)
        extended = [b.op("Concat", x, zero, axis=2) for x in used]
        scores = b.op("Where", mask, b.const(np.array(0.0, np.float32)), b.const(np.array(_NEG, np.float32)))
        heads = b.op("Concat", b.op("Shape", scores, end=1), b.ints(m.num_heads), b.op("Shape", scores, start=2),
                     axis=0)
        per_head = b.op("Expand", scores, heads)  # [B, H, S, T]
        return extended, b.to_compute(_with_sink_column(self.c, per_head, i, [1, m.num_heads, 1, 1]))

    def attended(self, full: str, zero: str) -> str:
        """The keys Attention reads from the written buffer: its first T = max(position) + 1 positions."""
        b = self.c.b
        return b.op("Slice", full, zero, b.unsqueeze(self.total, 0), b.ints(2))  # [B, Hkv, T, D]

    def last_token(self, x: str) -> str:
        """Row b's last token is where its position is largest (right padding pads with position 0)."""
        b = self.c.b
        last = b.op("ArgMax", io.POSITION_IDS, axis=1, keepdims=1)  # [B, 1]
        return b.unsqueeze(b.op("GatherND", x, last, batch_dims=1), 1)


class OnnxStaticAttention(OnnxAttention):
    """OnnxAttention over the whole bound buffer: Attention reads all max_seq positions of [B, Hkv, max_seq, D] under
    a [B, 1, S, max_seq] mask (key t visible iff t <= the query's position, and inside its window), so the key length
    is the buffer's, never max(position) + 1: with the buffer's sequence axis static (TensorRT builds) no shape
    depends on the data. Masked keys contribute exactly zero; the buffer must hold finite values (it is zeroed at
    allocation, then holds only written K/V)."""

    def __init__(self, c: Ctx) -> None:
        DecomposedAttention.__init__(self, c)
        b = c.b
        self._write_index = None
        if io.PAST_KEY.format(i=0) in c.inputs:  # (a model without attention, Mamba-2's, has no buffer to read)
            max_seq = b.op("Squeeze", b.op("Shape", io.PAST_KEY.format(i=0), start=2, end=3), b.ints(0))  # []
            self.keys = b.op("Range", b.const(np.array(0, np.int64)), max_seq, b.const(np.array(1, np.int64)))

    def attended(self, full: str, zero: str) -> str:
        return full  # [B, Hkv, max_seq, D]


LOWERINGS: dict[str, type[DecomposedAttention] | type[GroupQueryAttention]] = {
    "decomposed": DecomposedAttention, "gqa": GroupQueryAttention, "llmc": CachedAttention, "onnx": OnnxAttention,
    "onnx-static": OnnxStaticAttention}

