"""The export-friendly decoder, written directly as ONNX: prefill and decode-with-past graphs.

No tracing of transformers' modeling code (and its cache classes): every node is placed here, so the graphs stay
the same across transformers versions and the parity tests decide whether they are right.
Shapes in comments: B batch, S new tokens, P past length, T = P + S, H/Hkv heads, G = H // Hkv, D head dim.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from llmc.export import io_names as io
from llmc.export.arch import Checkpoint
from llmc.export.builder import DTYPES, GraphBuilder
from llmc.manifest import GraphSpec, ModelSpec


def build_graph(ckpt: Checkpoint, spec: GraphSpec, dtype: str, opset: int) -> tuple[onnx.GraphProto, list[str]]:
    """Build one graph (prefill when it has no past inputs); returns it and the weight names it uses."""
    b = GraphBuilder(opset, dtype)
    m = ckpt.spec
    with_past = any(t.name.startswith("past_key_values") for t in spec.inputs)
    ids, mask, pos = io.INPUT_IDS, io.ATTENTION_MASK, io.POSITION_IDS
    x = b.op("Gather", b.weight("embed.weight"), ids)  # [B, S, Hd]
    if m.positions == "learned":
        x = b.op("Add", x, b.op("Gather", b.weight("pos_embed.weight"), pos))
    allowed = _attention_allowed(b, ids, mask)
    rope = _rope_tables(b, ckpt, pos) if m.positions == "rope" else None
    for i in range(m.num_layers):
        past = (io.PAST_KEY.format(i=i), io.PAST_VALUE.format(i=i)) if with_past else None
        present = (io.PRESENT_KEY.format(i=i), io.PRESENT_VALUE.format(i=i))
        x = _layer(b, m, i, x, allowed, rope, past, present)
    if spec.logits == "last":
        x = _last_valid_token(b, x, mask)  # [B, 1, Hd]
    x = _norm(b, m, x, "norm")
    _lm_head(b, m, x)
    graph = helper.make_graph(
        b.nodes,
        spec.file.removesuffix(".onnx"),
        [_value_info(t) for t in spec.inputs],
        [_value_info(t) for t in spec.outputs],
        initializer=list(b.constants.values()),
    )
    return graph, b.weights_used


def _value_info(t: object) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, DTYPES[t.dtype], list(t.shape))  # type: ignore[attr-defined]


def _attention_allowed(b: GraphBuilder, ids: str, mask: str) -> str:
    """[B, 1, 1, S, T] bool: key t is visible to new token s iff t <= P + s and attention_mask[b, t] == 1."""
    s, t = b.dim(ids, 1), b.dim(mask, 1)
    zero, one = b.const(np.array(0, np.int64)), b.const(np.array(1, np.int64))
    t_scalar, s_scalar = b.op("Squeeze", t), b.op("Squeeze", s)
    key_idx = b.op("Range", zero, t_scalar, one)  # [T]
    query_idx = b.op("Range", b.op("Sub", t_scalar, s_scalar), t_scalar, one)  # [S]
    causal = b.op("LessOrEqual", b.unsqueeze(key_idx, 0), b.unsqueeze(query_idx, 1))  # [S, T]
    valid = b.unsqueeze(b.cast(mask, "bool"), 1)  # [B, 1, T]
    return b.unsqueeze(b.op("And", causal, valid), 1, 2)  # [B, 1, 1, S, T]


def _rope_tables(b: GraphBuilder, ckpt: Checkpoint, pos: str) -> tuple[str, str]:
    """cos, sin [B, 1, S, D] computed in fp32 from position_ids, as transformers does."""
    assert ckpt.inv_freq is not None
    inv_freq = b.const(ckpt.inv_freq.astype(np.float32))  # [D/2]
    freqs = b.op("Mul", b.unsqueeze(b.cast(pos, "float32"), 2), inv_freq)  # [B, S, D/2]
    emb = b.op("Concat", freqs, freqs, axis=-1)  # [B, S, D]
    scale = ckpt.spec.rope_attention_scaling
    tables = []
    for fn in ("Cos", "Sin"):
        t = b.op(fn, emb)
        if scale != 1.0:
            t = b.op("Mul", t, b.const(np.array(scale, np.float32)))
        tables.append(b.unsqueeze(b.to_compute(t), 1))
    return tables[0], tables[1]


def _apply_rope(b: GraphBuilder, x: str, rope: tuple[str, str], half: int) -> str:
    cos, sin = rope
    x1, x2 = b.split(x, [half, half])
    rotated = b.op("Concat", b.op("Neg", x2), x1, axis=-1)
    return b.op("Add", b.op("Mul", x, cos), b.op("Mul", rotated, sin))


def _linear(b: GraphBuilder, x: str, name: str, bias: bool) -> str:
    y = b.op("MatMul", x, b.weight(f"{name}.weight"))
    return b.op("Add", y, b.weight(f"{name}.bias")) if bias else y


def _norm(b: GraphBuilder, m: ModelSpec, x: str, name: str) -> str:
    """RMSNorm / LayerNorm, always accumulated in fp32 (fp16 overflows here)."""
    xf = b.to_float32(x)
    w = b.to_float32(b.weight(f"{name}.weight"))
    if m.norm == "layer":
        y = b.op("LayerNormalization", xf, w, b.to_float32(b.weight(f"{name}.bias")), axis=-1, epsilon=m.norm_eps)
    else:
        var = b.reduce_mean(b.op("Pow", xf, b.const(np.array(2.0, np.float32))), -1)
        denom = b.op("Sqrt", b.op("Add", var, b.const(np.array(m.norm_eps, np.float32))))
        y = b.op("Mul", b.op("Div", xf, denom), w)
    return b.to_compute(y)


def _layer(b: GraphBuilder, m: ModelSpec, i: int, x: str, allowed: str, rope: tuple[str, str] | None,
           past: tuple[str, str] | None, present: tuple[str, str]) -> str:
    p = f"layers.{i}"
    h = _norm(b, m, x, f"{p}.norm1")
    x = b.op("Add", x, _attention(b, m, p, h, allowed, rope, past, present))
    h = _norm(b, m, x, f"{p}.norm2")
    return b.op("Add", x, _mlp(b, m, p, h))


def _heads(b: GraphBuilder, x: str, heads: int, head_dim: int) -> str:
    """[B, S, heads*D] -> [B, heads, S, D]"""
    return b.op("Transpose", b.op("Reshape", x, b.ints(0, 0, heads, head_dim)), perm=[0, 2, 1, 3])


def _attention(b: GraphBuilder, m: ModelSpec, p: str, h: str, allowed: str, rope: tuple[str, str] | None,
               past: tuple[str, str] | None, present: tuple[str, str]) -> str:
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    qkv = _linear(b, h, f"{p}.qkv", m.qkv_bias)  # [B, S, (H + 2 Hkv) D]
    q, k, v = b.split(qkv, [H * D, Hkv * D, Hkv * D])
    q, k, v = _heads(b, q, H, D), _heads(b, k, Hkv, D), _heads(b, v, Hkv, D)
    if rope is not None:
        q, k = _apply_rope(b, q, rope, D // 2), _apply_rope(b, k, rope, D // 2)
    if past is not None:
        k = b.output("Concat", [past[0], k], present[0], axis=2)  # [B, Hkv, T, D]
        v = b.output("Concat", [past[1], v], present[1], axis=2)
    else:
        k = b.output("Identity", [k], present[0])
        v = b.output("Identity", [v], present[1])
    # Grouped heads without copying K/V: q as [B, Hkv, G, S, D] against K/V broadcast as [B, Hkv, 1, T, D].
    q5 = b.op("Mul", b.op("Reshape", q, b.ints(0, Hkv, H // Hkv, -1, D)), b.scalar(1.0 / math.sqrt(D)))
    k_t = b.op("Transpose", b.unsqueeze(k, 2), perm=[0, 1, 2, 4, 3])  # [B, Hkv, 1, D, T]
    scores = b.to_float32(b.op("MatMul", q5, k_t))  # [B, Hkv, G, S, T], softmax in fp32
    scores = b.op("Where", allowed, scores, b.const(np.array(np.finfo(np.float32).min, np.float32)))
    probs = b.to_compute(b.op("Softmax", scores, axis=-1))
    out = b.op("MatMul", probs, b.unsqueeze(v, 2))  # [B, Hkv, G, S, D]
    out = b.op("Transpose", b.op("Reshape", out, b.ints(0, H, -1, D)), perm=[0, 2, 1, 3])  # [B, S, H, D]
    out = b.op("Reshape", out, b.ints(0, 0, H * D))
    return _linear(b, out, f"{p}.o", m.family == "gpt2")


def _activation(b: GraphBuilder, m: ModelSpec, x: str) -> str:
    if m.activation == "silu":
        return b.op("Mul", x, b.op("Sigmoid", x))
    if m.activation == "gelu":
        erf = b.op("Erf", b.op("Mul", x, b.scalar(1 / math.sqrt(2.0))))
        return b.op("Mul", b.op("Mul", x, b.scalar(0.5)), b.op("Add", erf, b.scalar(1.0)))
    # tanh approximation (gelu_new): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    cube = b.op("Mul", b.op("Mul", x, x), x)
    inner = b.op("Mul", b.op("Add", x, b.op("Mul", cube, b.scalar(0.044715))), b.scalar(math.sqrt(2 / math.pi)))
    return b.op("Mul", b.op("Mul", x, b.scalar(0.5)), b.op("Add", b.op("Tanh", inner), b.scalar(1.0)))


def _mlp(b: GraphBuilder, m: ModelSpec, p: str, h: str) -> str:
    if m.family == "gpt2":
        return _linear(b, _activation(b, m, _linear(b, h, f"{p}.fc", True)), f"{p}.proj", True)
    gate, up = b.split(b.op("MatMul", h, b.weight(f"{p}.gate_up.weight")), [m.intermediate_size] * 2)
    return b.op("MatMul", b.op("Mul", _activation(b, m, gate), up), b.weight(f"{p}.down.weight"))


def _last_valid_token(b: GraphBuilder, x: str, mask: str) -> str:
    """Hidden state of each row's last valid token (works for right or left padding): [B, S, Hd] -> [B, 1, Hd]."""
    s = b.op("Squeeze", b.dim(mask, 1))
    ranks = b.op("Range", b.const(np.array(1, np.int64)), b.op("Add", s, b.const(np.array(1, np.int64))),
                 b.const(np.array(1, np.int64)))  # [S]: 1..S
    last = b.op("ArgMax", b.op("Mul", mask, ranks), axis=1, keepdims=1)  # [B, 1]
    return b.unsqueeze(b.op("GatherND", x, last, batch_dims=1), 1)


def _lm_head(b: GraphBuilder, m: ModelSpec, x: str) -> None:
    """logits = x @ W^T with W [V, Hd] (the embedding when tied: stored once, read transposed by Gemm)."""
    w = b.weight("embed.weight" if m.tie_embeddings else "lm_head.weight")
    flat = b.op("Reshape", x, b.ints(-1, m.hidden_size))
    logits = b.op("Gemm", flat, w, transB=1)  # [B*S, V]
    out_shape = b.op("Concat", b.op("Shape", x, start=0, end=2), b.ints(m.vocab_size), axis=0)
    logits = b.op("Reshape", logits, out_shape)
    if b.dtype == "float32":
        b.output("Identity", [logits], io.LOGITS)
    else:
        b.output("Cast", [logits], io.LOGITS, to=DTYPES["float32"])
