"""Every graph input/output name and axis, defined once (Optimum / ONNX Runtime GenAI conventions).

Padding convention: right padding. Row b's tokens sit at cache positions 0..len_b-1; `attention_mask` marks the
valid positions of past + new tokens; `position_ids` carry each token's position in its own sequence.
"""

from __future__ import annotations

from llmc.manifest import GraphSpec, KVSpec, ModelSpec, StateSpec, TensorSpec

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
SEQLENS_K = "seqlens_k"  # [B] int32: tokens of each row after this step, minus one
TOTAL_SEQ_LEN = "total_sequence_length"  # [] int32: max over rows of seqlens_k + 1
PAST_KEY = "past_key_values.{i}.key"
PAST_VALUE = "past_key_values.{i}.value"
PRESENT_KEY = "present.{i}.key"
PRESENT_VALUE = "present.{i}.value"
BLOCK_TABLE = "block_table"  # [B, max_blocks] int32: paged KV memory, row b's position t in block [b, t // block]
NEW_TOKENS = "new_tokens"  # [B] int32 (paged graphs, graphs with states): row b's new tokens in this run,
# right-padded to the width
PAST_CONV = "past_conv.{i}"  # [B, conv_kernel - 1, hidden]: a conv layer's last inputs before this run (LFM2)
PRESENT_CONV = "present_conv.{i}"  # the same after it (each row's last valid ones)
# a linear-attention layer's (Gated DeltaNet): its convolution's last inputs [B, taps - 1, 2 K + V] and its recurrent
# state [B, v heads, k dim, v dim], before and after the run
PAST_LINEAR_CONV, PRESENT_LINEAR_CONV = "past_linear_conv.{i}", "present_linear_conv.{i}"
PAST_RECURRENT, PRESENT_RECURRENT = "past_recurrent.{i}", "present_recurrent.{i}"
# a mamba layer's (Mamba-2): its convolution's last inputs [B, taps - 1, x + B + C channels] (Mamba-1's: x) and its
# state-space state [B, heads, state, head dim]
PAST_MAMBA_CONV, PRESENT_MAMBA_CONV = "past_mamba_conv.{i}", "present_mamba_conv.{i}"
PAST_SSM, PRESENT_SSM = "past_ssm.{i}", "present_ssm.{i}"
STATE_ROWS = "state_rows"  # [B] int32 (graphs with pooled states): row b's state in the pools [num_slots, ...]

STANDARD_INPLACE = ("onnx", "onnx-static")  # in-place lowerings of standard ops: Attention + TensorScatter

BATCH, SEQ, PAST, TOTAL, MAX_SEQ = "batch", "sequence", "past_sequence", "total_sequence", "max_sequence"
NUM_BLOCKS, BLOCK, MAX_BLOCKS, NUM_SLOTS = "num_blocks", "block_size", "max_blocks", "num_slots"


def kv_spec(model: ModelSpec, dtype: str, layout: str = "concat") -> KVSpec:
    convs = sum(1 for i in range(model.num_layers) if model.is_conv(i))
    linear = sum(1 for i in range(model.num_layers) if model.is_linear(i))
    states: tuple[StateSpec, ...] = ((StateSpec(PAST_CONV, PRESENT_CONV, convs, (model.conv_kernel - 1,
                                                                             model.hidden_size)),) if convs else ())
    if linear:
        channels = 2 * model.linear_k_heads * model.linear_k_dim + model.linear_v_heads * model.linear_v_dim
        states += (StateSpec(PAST_LINEAR_CONV, PRESENT_LINEAR_CONV, linear, (model.linear_conv_kernel - 1, channels)),
                   StateSpec(PAST_RECURRENT, PRESENT_RECURRENT, linear,
                             (model.linear_v_heads, model.linear_k_dim, model.linear_v_dim)))
    if mamba := sum(1 for i in range(model.num_layers) if model.is_mamba(i)):
        states += (StateSpec(PAST_MAMBA_CONV, PRESENT_MAMBA_CONV, mamba, (model.mamba_conv_kernel - 1,
                                                                           mamba_channels(model))),
                   StateSpec(PAST_SSM, PRESENT_SSM, mamba, (model.mamba_heads, model.mamba_state, model.mamba_head_dim)))
    return KVSpec(
        layout=layout,
        dtype=dtype,
        num_layers=len(model.kv_layers),
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        past_key=PAST_KEY,
        past_value=PAST_VALUE,
        present_key=PRESENT_KEY,
        present_value=PRESENT_VALUE,
        states=states,
        layer_dims=(tuple((model.kv_heads_of(i), model.head_dim_of(i)) for i in model.kv_layers)
                    if model.layer_head_dims or model.layer_kv_heads else ()),
    )


def mamba_channels(model: ModelSpec) -> int:
    """A mamba layer's convolved channels: x (heads x head dim), then B and C (groups x state each; Mamba-1's come
    from x after the convolution)."""
    inner = model.mamba_heads * model.mamba_head_dim
    return inner if model.mamba_version == 1 else inner + 2 * model.mamba_groups * model.mamba_state


def layer_kv(model: ModelSpec, layer: int, kind: str) -> tuple[str, str]:
    """Layer `layer`'s key and value names of one kind ("past" or "present"), by its place among the layers with a
    KV cache (model.kv_index)."""
    j = model.kv_index(layer)
    k, v = (PAST_KEY, PAST_VALUE) if kind == "past" else (PRESENT_KEY, PRESENT_VALUE)
    return k.format(i=j), v.format(i=j)


def _token_inputs(mask_len: str) -> list[TensorSpec]:
    return [
        TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ)),
        TensorSpec(ATTENTION_MASK, "int64", (BATCH, mask_len)),
        TensorSpec(POSITION_IDS, "int64", (BATCH, SEQ)),
    ]


def _kv(kv: KVSpec, kind: str, length: str) -> list[TensorSpec]:
    lead, span = (NUM_BLOCKS, BLOCK) if kv.paged else (BATCH, length)  # paged: a pool [num_blocks, Hkv, block, row]
    names = kv.names(kind)
    return [TensorSpec(n, kv.dtype, (lead, kv.dims(j // 2)[0], span, kv.row_of(j // 2))) for j, n in enumerate(names)]


def _states(kv: KVSpec, kind: str) -> list[TensorSpec]:
    return [TensorSpec(n, s.dtype, (NUM_SLOTS if s.pooled else BATCH, *s.shape)) for s in kv.states
            for n in s.names(kind)]


def prefill_spec(model: ModelSpec, kv: KVSpec, file: str = "prefill.onnx") -> GraphSpec:
    """Prompt in, logits at each row's last valid token [B, 1, V] and the cache [B, Hkv, S, D] (and the states) out."""
    return GraphSpec(
        file=file,
        inputs=tuple(_token_inputs(SEQ)),
        outputs=(TensorSpec(LOGITS, "float32", (BATCH, 1, model.logits_size)), *_kv(kv, "present", SEQ),
                 *_states(kv, "present")),
        logits="last",
    )


def decode_spec(model: ModelSpec, kv: KVSpec, file: str = "decode.onnx") -> GraphSpec:
    """New tokens [B, S] (S = 1 when decoding) + past [B, Hkv, P, D] in; logits [B, S, V] and [B, Hkv, P+S, D] out."""
    return GraphSpec(
        file=file,
        inputs=(*_token_inputs(TOTAL), *_kv(kv, "past", PAST), *_states(kv, "past")),
        outputs=(TensorSpec(LOGITS, "float32", (BATCH, SEQ, model.logits_size)), *_kv(kv, "present", TOTAL),
                 *_states(kv, "present")),
        logits="all",
    )


def rotary_in_graph(model: ModelSpec, attention: str) -> bool:
    """Whether q and k are rotated by graph ops from position_ids, rather than inside the attention op: always for
    the standard-op lowerings; for GroupQueryAttention / llmc's operator when a row's table depends on its own
    length (longrope), q and k are normed after their rotation (Hunyuan), or GroupQueryAttention cannot rotate the
    model's partial width (R / 2 a multiple of 8)."""
    if model.positions != "rope" or not any(model.has_rope(i) for i in range(model.num_layers)):
        return False
    if attention in ("decomposed", *STANDARD_INPLACE) or model.rope_long_after or model.qk_norm_after_rope:
        return True
    return attention == "gqa" and any((model.rotated_dims_of(i) // 2) % 8 for i in range(model.num_layers)
                                      if model.attends(i))


def _inplace_inputs(model: ModelSpec, kv: KVSpec, attention: str) -> list[TensorSpec]:
    inputs = [TensorSpec(INPUT_IDS, "int64", (BATCH, SEQ))]
    if (model.positions == "learned" or attention in STANDARD_INPLACE or rotary_in_graph(model, attention)
            or model.query_scale_beta  # (Ministral 3's queries scaled by their positions)
            or (attention == "gqa" and any(model.shares_kv(i) for i in range(model.num_layers)))):  # (a layer
        # reading another's cache in standard ops: GroupQueryAttention._read_shared)
        inputs.append(TensorSpec(POSITION_IDS, "int64", (BATCH, SEQ)))
    if attention in ("gqa", "llmc"):
        inputs += [TensorSpec(SEQLENS_K, "int32", (BATCH,)), TensorSpec(TOTAL_SEQ_LEN, "int32", ())]
    if kv.paged:
        inputs.append(TensorSpec(BLOCK_TABLE, "int32", (BATCH, MAX_BLOCKS)))
    if kv.paged or kv.states:  # (a state keeps each row's last valid inputs: where they end)
        inputs.append(TensorSpec(NEW_TOKENS, "int32", (BATCH,)))
    if any(s.pooled for s in kv.states):
        inputs.append(TensorSpec(STATE_ROWS, "int32", (BATCH,)))
    return inputs + _kv(kv, "past", MAX_SEQ) + _states(kv, "past")


def inplace_specs(model: ModelSpec, kv: KVSpec, attention: str = "gqa",
                  one_graph: bool = False) -> tuple[GraphSpec, GraphSpec]:
    """The "inplace" layout: one [B, Hkv, max_len, D] buffer per layer and kind, bound as past AND present.

    Prefill (right-padded prompts, empty rows) returns logits at each row's last token [B, 1, V]; decode (each row
    S new tokens after its cached ones) returns [B, S, V]. "gqa" graphs take seqlens_k / total_sequence_length,
    "onnx" / "onnx-static" graphs (Attention + TensorScatter) position_ids.

    `one_graph`: prefill and decode are the same graph, `model.onnx`, with logits at each row's last new token
    (all a runtime needs: one-token decode rows, a one-row prompt chunk, right-padded prompts), so an engine holds
    its weights once.
    """
    present = [*_kv(kv, "present", MAX_SEQ), *_states(kv, "present")]
    inputs = tuple(_inplace_inputs(model, kv, attention))
    prefill = GraphSpec("model.onnx" if one_graph else "prefill.onnx", inputs,
                        (TensorSpec(LOGITS, "float32", (BATCH, 1, model.logits_size)), *present), logits="last")
    if one_graph:
        return prefill, prefill
    decode = GraphSpec("decode.onnx", inputs,
                       (TensorSpec(LOGITS, "float32", (BATCH, SEQ, model.logits_size)), *present), logits="all")
    return prefill, decode
