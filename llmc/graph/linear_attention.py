"""Layers that keep a fixed-size state per sequence instead of a KV cache (KVSpec.states): LFM2's gated short
convolution, Qwen3.5's Gated DeltaNet (a linear attention over a recurrent state), Kimi Linear's Kimi Delta Attention
(the same with a decay per key dim), Mamba-2's mixer (a state-space recurrence: the same operator without the
delta) and Mamba-1's (its selective scan: a decay per channel and state element, the operator's optional A).

A run's new tokens are right-padded: row b has n_b of them (the in-place graphs' new_tokens, or the new part of the
export graphs' attention mask). Each state after the run is the row's own: a convolution's last inputs are its last
taps - 1 *valid* ones, and a padded token neither decays nor writes the recurrent state.
Shapes: B batch, S new tokens, C channels, H value heads, K / V key / value head dims.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import helper

from llmc.graph import io_names as io
from llmc.graph.builder import DTYPES, GraphBuilder
from llmc.graph.layers import LLMC_DOMAIN, Ctx, linear, norm

FAR = 2**62  # a Slice end past any axis


def new_counts(c: Ctx) -> str:
    """[B] int64: each row's new tokens in this run."""
    b = c.b
    if io.NEW_TOKENS in c.inputs:
        return b.cast(io.NEW_TOKENS, "int64")
    width = b.dim(io.INPUT_IDS, 1)  # (the export's graphs: the mask's last S columns are this run's)
    new = b.op("Slice", io.ATTENTION_MASK, b.op("Neg", width), b.ints(FAR), b.ints(1))
    return b.op("ReduceSum", new, b.ints(1), keepdims=0)


def _state_in(c: Ctx, past: str) -> str:
    """The run's rows of a state input: the input itself [B, ...], or, where the graph keeps the state pooled (the
    in-place graphs: [num_slots, ...] bound as both input and output), the rows state_rows names."""
    b = c.b
    return b.op("Gather", past, io.STATE_ROWS, axis=0) if io.STATE_ROWS in c.inputs else past


def _state_out(c: Ctx, x: str, name: str, past: str) -> None:
    """Graph output `name` (fp32, as every state is held) from the rows' states after the run x [B, ...]: x itself,
    or, pooled, x scattered into the pool at the rows' slots (in place: ONNX Runtime's ScatterND writes only those
    rows where its output is its input's memory)."""
    b = c.b
    x = b.to_float32(x)
    if io.STATE_ROWS in c.inputs:
        b.output("ScatterND", [past, b.unsqueeze(b.cast(io.STATE_ROWS, "int64"), 1), x], name)
    else:
        b.output("Identity", [x], name)


def causal_conv(c: Ctx, x: str, weight: str, taps: int, channels: int, past: str, present: str,
                bias: str | None = None) -> str:
    """Depthwise causal convolution of x [B, S, C] after the row's last taps - 1 inputs (input `past`
    [B, taps - 1, C]; zeros before a prompt, in a graph without it); weight [taps, C], tap taps - 1 on the newest
    input. Writes `present`: each row's last taps - 1 valid inputs."""
    b = c.b
    if past in c.inputs:
        full = b.op("Concat", b.to_compute(_state_in(c, past)), x, axis=1)  # [B, taps - 1 + S, C]
    else:  # a prompt's first run
        full = b.op("Pad", x, b.ints(0, taps - 1, 0, 0, 0, 0))
    y = None
    for k in range(taps):  # tap k meets the input taps - 1 - k positions before each output's own
        ends = b.ints(k - (taps - 1) if k < taps - 1 else FAR)
        tap = b.op("Mul", b.op("Slice", full, b.ints(k), ends, b.ints(1)), b.op("Gather", weight, b.ints(k)))
        y = tap if y is None else b.op("Add", y, tap)
    assert y is not None
    if bias is not None:
        y = b.op("Add", y, bias)
    # the row's last taps - 1 valid inputs: full's columns n_b .. n_b + taps - 2
    cols = b.op("Add", b.unsqueeze(new_counts(c), 1), b.const(np.arange(taps - 1, dtype=np.int64)[None, :]))
    index = b.op("Expand", b.unsqueeze(cols, 2), b.op("Concat", b.dim(cols, 0), b.ints(taps - 1, channels), axis=0))
    _state_out(c, b.op("GatherElements", full, index, axis=1), present, past)
    return y


def short_conv(c: Ctx, i: int, h: str) -> str:
    """LFM2's gated short convolution before its output product: B, C, x = h @ conv_in; C * conv(B * x)."""
    b, m = c.b, c.m
    gate_b, gate_c, xs = b.split(linear(c, h, f"layers.{i}.conv_in"), [m.hidden_size] * 3)
    j = m.state_index(i)
    bias = b.weight(f"layers.{i}.conv.bias") if c.has(f"layers.{i}.conv.bias") else None
    y = causal_conv(c, b.op("Mul", gate_b, xs), b.weight(f"layers.{i}.conv.weight"), m.conv_kernel, m.hidden_size,
                    io.PAST_CONV.format(i=j), io.PRESENT_CONV.format(i=j), bias)
    return b.op("Mul", gate_c, y)


def gated_delta_net(c: Ctx, i: int, h: str) -> str:
    """Qwen3.5's Gated DeltaNet before its output product, [B, S, H * V]: q, k, v, z, b, a from one product
    (lin_in); q, k, v through the causal convolution and SiLU; q and k L2-normed (q times K^-0.5), each key head
    serving H / its count value heads; then per token, on the state M [B, H, K, V]:
    M <- M exp(g), g = A softplus(a + dt_bias) (A = -exp(A_log)); M <- M + k (beta (v - k M)), beta = sigmoid(b);
    o = q M; o RMS-normed over V times silu(z)."""
    b, m = c.b, c.m
    p = f"layers.{i}"
    hk, hv, dk, dv = m.linear_k_heads, m.linear_v_heads, m.linear_k_dim, m.linear_v_dim
    key, value = hk * dk, hv * dv
    qkv, z, beta_in, a = b.split(linear(c, h, f"{p}.lin_in"), [2 * key + value, value, hv, hv])
    g = b.op("Mul", b.to_float32(b.weight(f"{p}.lin_A")),
             b.op("Softplus", b.op("Add", b.to_float32(a), b.to_float32(b.weight(f"{p}.lin_dt_bias")))))
    out = _delta_rule(c, i, qkv, g, beta_in, per_key=False)
    gate = _heads(b, b.to_float32(z), hv, dv)
    normed = norm(c, b.to_compute(out), f"{p}.lin_norm", m.linear_norm_eps)
    y = b.op("Mul", b.to_float32(normed), b.op("Mul", gate, b.op("Sigmoid", gate)))
    return b.to_compute(b.op("Reshape", y, b.ints(0, 0, value)))


def kimi_delta_attention(c: Ctx, i: int, h: str) -> str:
    """Kimi Linear's Kimi Delta Attention before its output product, [B, S, H * K]: the Gated DeltaNet's rule (H heads
    of K = V dims) with a decay per key dim, g = A softplus(h @ f_a @ f_b + dt_bias) [B, S, H, K] (A = -exp(A_log) a
    head); q, k, v, f_a, b, g_a from one product (kda_in); o RMS-normed over V times sigmoid(h @ g_a @ g_b)."""
    b, m = c.b, c.m
    p = f"layers.{i}"
    heads, dim = m.linear_v_heads, m.linear_v_dim
    width = heads * dim
    qkv, f_a, beta_in, g_a = b.split(linear(c, h, f"{p}.kda_in"), [3 * width, dim, heads, dim])
    g = b.op("Softplus", b.op("Add", b.to_float32(linear(c, f_a, f"{p}.kda_f")),
                              b.to_float32(b.weight(f"{p}.lin_dt_bias"))))
    g = b.op("Mul", _heads(b, g, heads, dim), b.unsqueeze(b.to_float32(b.weight(f"{p}.lin_A")), 1))
    out = _delta_rule(c, i, qkv, g, beta_in, per_key=True)
    gate = _heads(b, b.to_float32(linear(c, g_a, f"{p}.kda_g")), heads, dim)
    normed = norm(c, b.to_compute(out), f"{p}.lin_norm")
    y = b.op("Mul", b.to_float32(normed), b.op("Sigmoid", gate))
    return b.to_compute(b.op("Reshape", y, b.ints(0, 0, width)))


def _heads(b: GraphBuilder, x: str, n: int, d: int) -> str:
    """[B, S, n * d] -> [B, S, n, d]."""
    return b.op("Reshape", x, b.ints(0, 0, n, d))


def _delta_rule(c: Ctx, i: int, qkv: str, g: str, beta_in: str, per_key: bool) -> str:
    """The delta rule of a linear-attention layer (its states: past_linear_conv, past_recurrent), [B, S, H, V] fp32:
    q, k, v (qkv) through the causal convolution and SiLU, q and k L2-normed (q times K^-0.5), beta = sigmoid(beta_in);
    g and beta zero on a padded token, which then neither decays nor writes the state."""
    b, m = c.b, c.m
    j = m.state_index(i)
    hk, hv, dk, dv = m.linear_k_heads, m.linear_v_heads, m.linear_k_dim, m.linear_v_dim
    key, value = hk * dk, hv * dv
    conv = causal_conv(c, qkv, b.weight(f"layers.{i}.lin_conv.weight"), m.linear_conv_kernel, 2 * key + value,
                       io.PAST_LINEAR_CONV.format(i=j), io.PRESENT_LINEAR_CONV.format(i=j))
    conv = b.to_float32(b.op("Mul", conv, b.op("Sigmoid", conv)))  # SiLU
    q, k, v = b.split(conv, [key, key, value])

    def l2(x: str) -> str:
        ss = b.op("ReduceSum", b.op("Mul", x, x), b.ints(-1), keepdims=1)
        return b.op("Mul", x, b.op("Reciprocal", b.op("Sqrt", b.op("Add", ss, b.const(np.array(1e-6, np.float32))))))

    q, k = l2(_heads(b, q, hk, dk)), l2(_heads(b, k, hk, dk))
    q = b.op("Mul", q, b.const(np.array(dk ** -0.5, np.float32)))
    valid = _valid(c)  # [B, S, 1]
    beta = b.op("Mul", b.op("Sigmoid", b.to_float32(beta_in)), valid)  # [B, S, H]
    if m.linear_beta_scale != 1.0:  # (OLMo Hybrid's: beta in [0, 2])
        beta = b.op("Mul", beta, b.const(np.array(m.linear_beta_scale, np.float32)))
    g = b.op("Mul", g, b.unsqueeze(valid, 3) if per_key else valid)
    return _recurrence(c, q, k, _heads(b, v, hv, dv), g, beta, io.PAST_RECURRENT.format(i=j),
                       io.PRESENT_RECURRENT.format(i=j), (hk, hv, dk, dv), delta=True, per_key=per_key)


def _valid(c: Ctx) -> str:
    """[B, S, 1] fp32: 1 on each row's new tokens, 0 on its right padding."""
    b = c.b
    steps = b.op("Range", b.const(np.array(0, np.int64)), b.op("Squeeze", b.dim(io.INPUT_IDS, 1), b.ints(0)),
                 b.const(np.array(1, np.int64)))
    valid = b.cast(b.op("Less", b.unsqueeze(steps, 0), b.unsqueeze(new_counts(c), 1)), "float32")  # [B, S]
    return b.unsqueeze(valid, 2)


def _recurrence(c: Ctx, q: str, k: str, v: str, g: str, beta: str, past: str, present: str,
                dims: tuple[int, int, int, int], delta: bool, per_key: bool = False, scan: str | None = None) -> str:
    """The gated recurrence over the run's tokens (delta_rule.h; without the delta, Mamba-2's), its state read from
    `past` (zeros before a prompt) and written as `present`: the outputs [B, S, H, V]. q, k [B, S, Hk, K],
    v [B, S, H, V], beta [B, S, H], g [B, S, H] (per_key: [B, S, H, K]) fp32; dims (Hk, H, K, V). scan: A [H, K, V]
    (Mamba-1's selective scan, without the delta): g and beta [B, S, H, V], M[i][j] decays by exp(g[j] A[i][j])."""
    b = c.b
    hk, hv, dk, dv = dims
    attrs: dict[str, Any] = {} if delta else {"delta": 0}
    if io.STATE_ROWS in c.inputs and c.opts.llmc_recurrence:  # the pool, in place: the engine zeroes a prompt's
        # row first; the node writes the graph's output itself (one between them would copy the whole pool)
        name = b._name("GatedDeltaRule")
        out = f"{name}_out0"
        b.nodes.append(helper.make_node("GatedDeltaRule", [q, k, v, g, beta, past, io.STATE_ROWS,
                                                           *([scan] if scan else [])], [out, present],
                                        name=name, domain=LLMC_DOMAIN, **attrs))
        return out
    if past in c.inputs:
        state = _state_in(c, past)
    else:  # zeros [B, H, K, V] before a prompt
        shape = b.op("Concat", b.dim(io.INPUT_IDS, 0), b.ints(hv, dk, dv), axis=0)
        state = b.op("ConstantOfShape", shape, value=helper.make_tensor("zero", DTYPES["float32"], [1], [0.0]))
    if c.opts.llmc_recurrence:  # llmc's operator (delta_rule.h): every token of every head in one node
        out, final = b.op_n("GatedDeltaRule", q, k, v, g, beta, state, *(["", scan] if scan else []), outputs=2,
                            domain=LLMC_DOMAIN, **attrs)
    else:
        if hv != hk:  # each key head serves hv / hk consecutive value heads
            q, k = (b.op("Reshape", b.op("Expand", b.unsqueeze(x, 3), b.ints(1, 1, 1, hv // hk, 1)),
                         b.ints(0, 0, hv, dk)) for x in (q, k))
        time_major = [b.op("Transpose", x, perm=[1, 0, 2, 3]) for x in (q, k, v)]
        time_major += [b.op("Transpose", g, perm=[1, 0, 2, 3] if per_key or scan else [1, 0, 2]),
                       b.op("Transpose", beta, perm=[1, 0, 2, 3] if scan else [1, 0, 2])]
        final, out = _delta_rule_loop(b, b.dim(io.INPUT_IDS, 1), state, time_major, delta, per_key, scan)
        out = b.op("Transpose", out, perm=[1, 0, 2, 3])  # [B, S, H, V]
    _state_out(c, final, present, past)
    return out


def mamba2(c: Ctx, i: int, h: str) -> str:
    """A Mamba-2 mixer, its output product included, [B, S, Hd] (ModelSpec.mamba_*): z, xBC, dt from one product
    (mamba_in); xBC through the causal convolution and SiLU; the state-space recurrence on M [B, H, N, P] (the
    operator's rule without the delta: k = B, q = C, v = x, beta = dt, g = dt A); y = C M + D x; y and silu(z)
    through the gated RMSNorm in groups (ModelSpec.mamba_norm); mamba_out."""
    b, m = c.b, c.m
    p, j = f"layers.{i}", m.state_index(i)
    hv, dv, dk, groups = m.mamba_heads, m.mamba_head_dim, m.mamba_state, m.mamba_groups
    inner = hv * dv
    z, xbc, dt = b.split(linear(c, h, f"{p}.mamba_in"), [inner, io.mamba_channels(m), hv])
    bias = b.weight(f"{p}.mamba_conv.bias") if c.has(f"{p}.mamba_conv.bias") else None
    conv = causal_conv(c, xbc, b.weight(f"{p}.mamba_conv.weight"), m.mamba_conv_kernel, io.mamba_channels(m),
                       io.PAST_MAMBA_CONV.format(i=j), io.PRESENT_MAMBA_CONV.format(i=j), bias)
    conv = b.to_float32(b.op("Mul", conv, b.op("Sigmoid", conv)))  # SiLU
    x, keys, queries = b.split(conv, [inner, groups * dk, groups * dk])
    x = b.op("Reshape", x, b.ints(0, 0, hv, dv))
    keys, queries = (b.op("Reshape", t, b.ints(0, 0, groups, dk)) for t in (keys, queries))
    dt = b.op("Softplus", b.op("Add", b.to_float32(dt), b.to_float32(b.weight(f"{p}.mamba_dt_bias"))))
    if m.mamba_dt_min:  # (Zamba2's time_step_min, as its trained scan clamps dt)
        dt = b.op("Max", dt, b.const(np.array(m.mamba_dt_min, np.float32)))
    dt = b.op("Mul", dt, _valid(c))  # a padded token: dt 0, so the state neither decays nor is written
    g = b.op("Mul", dt, b.to_float32(b.weight(f"{p}.mamba_A")))
    y = _recurrence(c, queries, keys, x, g, dt, io.PAST_SSM.format(i=j), io.PRESENT_SSM.format(i=j),
                    (groups, hv, dk, dv), delta=False)
    y = b.op("Add", y, b.op("Mul", x, b.unsqueeze(b.to_float32(b.weight(f"{p}.mamba_D")), 1)))  # [B, S, H, P]
    y = b.op("Reshape", y, b.ints(0, 0, inner))
    gate = b.to_float32(z)
    gate = b.op("Mul", gate, b.op("Sigmoid", gate))  # silu(z)
    if m.mamba_norm == "after_gate":
        y = norm(c, b.op("Mul", y, gate), f"{p}.mamba_norm", m.mamba_norm_eps, groups=groups)
    elif m.mamba_norm == "before_gate":  # (Falcon-H1's option)
        y = b.op("Mul", b.to_float32(norm(c, y, f"{p}.mamba_norm", m.mamba_norm_eps, groups=groups)), gate)
    else:  # "none" (Falcon-H1's default)
        y = b.op("Mul", y, gate)
    return linear(c, b.to_compute(y), f"{p}.mamba_out")


def mamba(c: Ctx, i: int, h: str) -> str:
    """The layer's Mamba mixer, its output product included (ModelSpec.mamba_version's)."""
    return (mamba1 if c.m.mamba_version == 1 else mamba2)(c, i, h)


def mamba1(c: Ctx, i: int, h: str) -> str:
    """A Mamba-1 mixer (Mamba, Falcon Mamba, Jamba), its output product included, [B, S, Hd]: x, z = h @ mamba_in;
    x through the causal convolution and SiLU; dt, B, C = x @ mamba_x (each RMS-normed where mamba_bcdt_norm: Falcon
    Mamba's and Jamba's); dt = softplus(dt @ mamba_dt + bias); the selective scan per channel c and state element n,
    on M [B, channels, N] held as [B, H, N, P] (the channels in mamba_heads heads of mamba_head_dim, sharing B and
    C): M[n][c] <- M[n][c] exp(dt[c] A[c][n]) + B[n] dt[c] x[c]; y = C M + D x; y silu(z) @ mamba_out."""
    b, m = c.b, c.m
    p, j = f"layers.{i}", m.state_index(i)
    hv, dv, dk = m.mamba_heads, m.mamba_head_dim, m.mamba_state
    inner = hv * dv
    xs, z = b.split(linear(c, h, f"{p}.mamba_in"), [inner, inner])
    bias = b.weight(f"{p}.mamba_conv.bias") if c.has(f"{p}.mamba_conv.bias") else None
    conv = causal_conv(c, xs, b.weight(f"{p}.mamba_conv.weight"), m.mamba_conv_kernel, inner,
                       io.PAST_MAMBA_CONV.format(i=j), io.PRESENT_MAMBA_CONV.format(i=j), bias)
    x = b.op("Mul", conv, b.op("Sigmoid", conv))  # SiLU
    dt, keys, queries = b.split(linear(c, x, f"{p}.mamba_x"), [m.mamba_dt_rank, dk, dk])
    if m.mamba_bcdt_norm:
        dt, keys, queries = (norm(c, t, f"{p}.mamba_{n}_norm", m.mamba_norm_eps)
                             for t, n in ((dt, "dt"), (keys, "b"), (queries, "c")))
    dt = b.op("Softplus", b.to_float32(linear(c, dt, f"{p}.mamba_dt")))
    dt = _heads(b, b.op("Mul", dt, _valid(c)), hv, dv)  # a padded token: dt 0, so the state neither decays nor is written
    keys, queries = (b.unsqueeze(b.to_float32(t), 2) for t in (keys, queries))  # [B, S, 1, N]: every channel's
    x = _heads(b, b.to_float32(x), hv, dv)
    y = _recurrence(c, queries, keys, x, dt, dt, io.PAST_SSM.format(i=j), io.PRESENT_SSM.format(i=j),
                    (1, hv, dk, dv), delta=False, scan=b.to_float32(b.weight(f"{p}.mamba_A")))
    y = b.op("Add", y, b.op("Mul", x, b.to_float32(b.weight(f"{p}.mamba_D"))))  # [B, S, H, P]
    gate = b.to_float32(z)
    y = b.op("Mul", b.op("Reshape", y, b.ints(0, 0, inner)), b.op("Mul", gate, b.op("Sigmoid", gate)))
    return linear(c, b.to_compute(y), f"{p}.mamba_out")


def _delta_rule_loop(b: GraphBuilder, width: str, state: str, time_major: list[str], delta: bool,
                     per_key: bool, scan: str | None = None) -> tuple[str, str]:
    """An ONNX Loop over the run's tokens: (the state after them [B, H, K, V], the outputs [S, B, H, V]).
    time_major: q, k [S, B, H, K], v [S, B, H, V], g [S, B, H] (per_key: [S, B, H, K]; scan: [S, B, H, V]), beta
    [S, B, H] (scan: [S, B, H, V]), read by the body from the outer scope, as scan (A [H, K, V]) is."""
    body = GraphBuilder(b.opset, "float32")
    body._count = b._count + 1000000  # (node names apart from the outer graph's)
    t = "delta_t"
    q_t, k_t, v_t, g_t, beta_t = (body.op("Gather", x, t, axis=0) for x in time_major)  # [B, H, ...]
    if scan:  # exp(g[j] A[i][j]) for every element of M
        decay = body.op("Exp", body.op("Mul", body.unsqueeze(g_t, 2), scan))
    else:
        decay = body.unsqueeze(body.op("Exp", g_t), *((3,) if per_key else (2, 3)))
    decayed = body.op("Mul", "delta_state_in", decay)
    new = body.unsqueeze(v_t, 2)  # [B, H, 1, V]
    if delta:  # less what the state already gives for k
        new = body.op("Sub", new, body.op("MatMul", body.unsqueeze(k_t, 2), decayed))
    scaled = body.op("Mul", new, body.unsqueeze(beta_t, *((2,) if scan else (2, 3))))
    written = body.op("Add", decayed, body.op("Mul", body.unsqueeze(k_t, 3), scaled))  # [B, H, K, V]
    out_t = body.op("Squeeze", body.op("MatMul", body.unsqueeze(q_t, 2), written), body.ints(2))  # [B, H, V]
    body.output("Identity", ["delta_cond_in"], "delta_cond_out")
    body.output("Identity", [written], "delta_state_out")
    body.output("Identity", [out_t], "delta_out_t")
    f32 = DTYPES["float32"]
    graph = helper.make_graph(
        body.nodes, "delta_rule",
        [helper.make_tensor_value_info(t, DTYPES["int64"], []),
         helper.make_tensor_value_info("delta_cond_in", DTYPES["bool"], []),
         helper.make_tensor_value_info("delta_state_in", f32, None)],
        [helper.make_tensor_value_info("delta_cond_out", DTYPES["bool"], []),
         helper.make_tensor_value_info("delta_state_out", f32, None),
         helper.make_tensor_value_info("delta_out_t", f32, None)],
        initializer=list(body.constants.values()))
    trips = b.op("Squeeze", width, b.ints(0))
    final, outs = b.op_n("Loop", trips, "", state, outputs=2, body=graph)
    return final, outs
