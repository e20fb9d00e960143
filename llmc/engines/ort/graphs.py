"""Rebuild an export's decoder for ONNX Runtime: GroupQueryAttention over an in-place KV buffer, optionally with
MatMulNBits int8/int4 weights. The weights come from the export's weights.bin (the graph builder is shared with
export; only the lowering differs), so every engine is built from the one export.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from llmc.errors import InputError
from llmc.graph import io_names
from llmc.graph.checkpoint import Checkpoint
from llmc.graph.decoder import LLMC_DOMAIN, MS, GraphOptions, build_graph
from llmc.graph.moe import ORT_FC1, ORT_FC2, quantize_experts, with_moe_weights
from llmc.graph.quant import (
    BF16TILES,
    BF16TILES_GATED,
    TILE_BLOCK,
    QuantSpec,
    compact_table,
    pack_bf16_tiles,
    quantize_weights,
)
from llmc.manifest import ExportManifest, GraphSpec, KVSpec
from llmc.onnx_store import MappedFiles, WeightFile, check_external_paths, load_graph, make_model

LINEAR_SUFFIXES = (".qkv.weight", ".o.weight", ".gate_up.weight", ".down.weight", ".fc.weight", ".proj.weight",
                   ".up.weight", ".moe_latent_in.weight", ".moe_latent_out.weight",  # (ungated and latent experts:
                   # Nemotron-H's)
                   ".q.weight", ".q_a.weight", ".q_b.weight", ".kv_a.weight",  # (these four: latent attention's)
                   ".attn_gate.weight", ".conv_in.weight",  # (LFM2's convolutions' input product)
                   ".lin_in.weight", ".kda_in.weight", ".kda_f.weight", ".kda_g.weight",  # (a Gated DeltaNet's,
                   # Kimi Delta Attention's)
                   ".mamba_in.weight", ".mamba_out.weight",  # (a Mamba-2 mixer's)
                   ".mamba_x.weight", ".mamba_dt.weight",  # (a Mamba-1 mixer's selective projections: WHOLE_BLOCKS)
                   ".zamba_linear.weight",  # (a Zamba2 block's product into its mixer's input)
                   ".kv.weight",  # (a mixture of attention's keys and values; its experts' q and o: .q, .o)
                   "ple_proj.weight", ".ple_gate.weight", ".ple_out.weight")  # (Gemma 4's per-layer embeddings')
# products quantized only where their input is a multiple of the kernels' block: a Mamba-1 mixer's selective ones
# (x_proj: dt, B and C; dt_proj: a dt rank such as Mamba-130M's 48 is not, and that product, 48 x 1,536, stays fp32)
# and Gemma 4's per-layer embeddings' (256 wide in the checkpoints)
WHOLE_BLOCKS = (".mamba_x.weight", ".mamba_dt.weight", "ple_proj.weight", ".ple_gate.weight", ".ple_out.weight")


def load_checkpoint(export_dir: Path, export: ExportManifest) -> Checkpoint:
    """Canonical weights by name, read back from the export's graphs (their initializers point into weights.bin):
    read-only views of the file's mapping, so a build holds the float weights in the page cache, not as a copy of
    its own (a 0.5 B-parameter model's 2 GB: measured)."""
    weights: dict[str, np.ndarray] = {}
    files = MappedFiles(export_dir)
    for spec in (export.prefill, export.decode):
        check_external_paths(export_dir / spec.file)  # also reads the graph: a damaged file is a clear error
        model = load_graph(export_dir / spec.file)
        for init in model.graph.initializer:
            if init.data_location == onnx.TensorProto.EXTERNAL and init.name not in weights:
                weights[init.name] = files.array(init)
    return Checkpoint(export.model, weights)


def quantizable(ckpt: Checkpoint) -> list[str]:
    """The linear layers' weights --quant quantizes (not the stacked [E, K, N] expert arrays: the "standard"
    mixture lowering's per-expert ones are quantized instead); the LM head besides."""
    return [n for n in ckpt.weights if n.endswith(LINEAR_SUFFIXES) and ckpt.weights[n].ndim == 2
            and not (n.endswith(WHOLE_BLOCKS) and ckpt.weights[n].shape[0] % TILE_BLOCK)]


def _swiglu_gate_up(ckpt: Checkpoint, name: str) -> bool:
    """A dense SwiGLU MLP's gate/up weight: llmc's tiles hold it in their gated form (one node, silu(x @ gate) *
    (x @ up), where its width allows)."""
    return (ckpt.spec.activation == "silu" and name.endswith(".gate_up.weight") and ".experts." not in name
            and not name.startswith("shared.") and ckpt.weights[name].shape[1] % 32 == 0)  # (Zamba2's shared
    # blocks add each use's adapter to gate_up before the activation)


def quantized(ckpt: Checkpoint, quant: QuantSpec) -> Checkpoint:
    """Linear layers and the LM head as MatMulNBits weights (4-bit layers: MatMulQ4 tiles with quant.kernel "llmc",
    a SwiGLU gate/up in its gated form); the embedding stays for the Gather."""
    names = quantizable(ckpt)
    gated = tuple(n for n in names if _swiglu_gate_up(ckpt, n))
    weights = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in ckpt.weights.items()}
    head = weights["embed.weight" if ckpt.spec.tie_embeddings else "lm_head.weight"]
    weights["lm_head.weight"] = head.T  # [Hd, V], quantized below (a view: the packers copy a slice at a time)
    out = quantize_weights(weights, names, quant, head="lm_head.weight", gated=gated)
    if "lm_head.weight" in out:  # (a layout keeping the head in fp32: the graph's Gemm reads it as [V, Hd], the
        # embeddings themselves where tied)
        del out["lm_head.weight"]
        if not ckpt.spec.tie_embeddings:
            out["lm_head.weight"] = head
    for i in range(ckpt.spec.num_layers):  # the "ort" mixture lowering's stacked experts: QMoE's blocks
        prefix = f"layers.{i}"
        if f"{prefix}.{ORT_FC1}" in out:
            out.update(quantize_experts(out, prefix, quant.bits, quant.block_size))
            del out[f"{prefix}.{ORT_FC1}"], out[f"{prefix}.{ORT_FC2}"]
    return Checkpoint(ckpt.spec, out)


def bf16_weights(ckpt: Checkpoint) -> Checkpoint:
    """Linear layers and the LM head as MatMulBF16 tiles (bf16, to nearest even; a SwiGLU gate/up in its gated
    form); the embedding stays for the Gather, norms and biases fp32."""
    weights = dict(ckpt.weights)
    for name in quantizable(ckpt):
        if _swiglu_gate_up(ckpt, name):
            weights[name + BF16TILES_GATED] = pack_bf16_tiles(weights.pop(name), gated=True)
        else:
            weights[name + BF16TILES] = pack_bf16_tiles(weights.pop(name))
    head = weights["embed.weight" if ckpt.spec.tie_embeddings else "lm_head.weight"]
    weights["lm_head.weight" + BF16TILES] = pack_bf16_tiles(np.ascontiguousarray(head.T))  # [Hd, V] as tiles
    if not ckpt.spec.tie_embeddings:
        weights.pop("lm_head.weight")
    return Checkpoint(ckpt.spec, weights)


def with_compact_embedding(ckpt: Checkpoint) -> Checkpoint:
    """The embedding's lookup table also in its exact compact form where it has one (quant.compact_table); the
    graph's Gather reads that, and the fp32 table stays only where a tied fp32 head reads it. The per-layer
    embeddings' table (Gemma 4 E2B / E4B: only looked up) is then kept in that form alone."""
    weights = dict(ckpt.weights)
    for name in ("embed.weight", "embed_per_layer.weight"):
        table = weights.get(name)
        if table is None or table.dtype != np.float32 or not (compact := compact_table(table, name)):
            continue
        weights.update(compact)
        if name == "embed_per_layer.weight":
            weights.pop(name)
    return Checkpoint(ckpt.spec, weights) if weights.keys() != ckpt.weights.keys() else ckpt


HEAD_PART_BYTES = 64 << 20  # an fp32 head larger than this is stored and run as row slices (with_head_parts)


def with_head_parts(ckpt: Checkpoint, part_bytes: int = 0) -> Checkpoint:
    """An fp32 LM head larger than `part_bytes` (default HEAD_PART_BYTES) as row slices lm_head.part{i} [V_i, Hd],
    one Gemm each, the logits concatenated. ONNX Runtime prepacks each constant Gemm input while its source is still
    held, so loading peaks at one slice above the resident engine instead of the whole head (SmolLM2's tied fp32
    head: 2 slices of 57 MB instead of 113 MB; 4 of 28 measured 0.96x at batch 8 against one Gemm, more calls). A
    tied head is sliced only where the embedding is looked up in its compact form (then the slices are the table's
    only fp32 copy); quantized and bf16 heads are left alone."""
    m = ckpt.spec
    if any(k.startswith("lm_head.weight") and k != "lm_head.weight" for k in ckpt.weights):
        return ckpt  # MatMulNBits / MatMulQ4 / MatMulQ8 / MatMulBF16 weights
    if m.tie_embeddings and not any(k.startswith("embed.weight.") for k in ckpt.weights):
        return ckpt  # the Gather reads the fp32 table itself: slices of it would store the head twice
    w = ckpt.weights.get("embed.weight" if m.tie_embeddings else "lm_head.weight")
    limit = part_bytes or HEAD_PART_BYTES
    if w is None or w.dtype != np.float32 or w.nbytes <= limit:
        return ckpt
    rows = -(-w.shape[0] // -(-w.nbytes // limit))
    parts = {f"lm_head.part{i}": np.ascontiguousarray(w[a:a + rows]) for i, a in enumerate(range(0, len(w), rows))}
    return Checkpoint(ckpt.spec, {**ckpt.weights, **parts})


ONNX_ATTENTION_OPSET = 24  # Attention with GQA + TensorScatter


def write_inplace_graphs(ckpt: Checkpoint, out: Path, dtype: str, opset: int, quant: QuantSpec | None,
                         attention: str = "gqa", fuse_norms: bool = False, one_graph: bool = False,
                         kv_dtype: str | None = None, moe: str = "ort",
                         paged: bool | None = None) -> tuple[KVSpec, GraphSpec, GraphSpec]:
    """Write prefill.onnx + decode.onnx (or, `one_graph`, model.onnx for both), one weights.bin, for the in-place
    KV layout into `out`.

    `fuse_norms` uses ONNX Runtime's Skip*LayerNormalization contrib ops (ONNX Runtime engines only). `kv_dtype`:
    the cache's dtype when it differs from the graph's (an fp16 cache under fp32 compute: "llmc" attention only).
    `moe`: the mixture-of-experts lowering (llmc/graph/moe.py). `paged` (default: with "llmc" attention, the only
    lowering that can page): the KV buffers are block pools addressed through a block table.
    """
    ckpt = with_moe_weights(ckpt, moe)
    paged = attention == "llmc" if paged is None else paged
    if paged and attention != "llmc":
        raise InputError(f"paged KV memory needs --attention llmc, got {attention}")
    kv = replace(io_names.kv_spec(ckpt.spec, kv_dtype or dtype, layout="inplace"), paged=paged)
    # a paged fp32 / fp16 cache holds its keys 16 positions at a time (a decode row's scores then take 16 keys a
    # product with nothing to reduce across lanes: docs/kv_cache.md); int8 rows keep their per-row scales
    kv = replace(kv, key_tiles=paged and kv.dtype != "int8")
    llmc_ops = attention == "llmc" or (quant is not None and quant.q4_tiles(quant.bits))
    # every state in its pool [num_slots, ...], read and written in place (llmc's GatedDeltaRule, or Gather and
    # ScatterND): a step copies none of them
    kv = replace(kv, states=tuple(replace(s, pooled=True) for s in kv.states))
    prefill, decode = io_names.inplace_specs(ckpt.spec, kv, attention, one_graph)
    if attention in io_names.STANDARD_INPLACE:
        opset = max(opset, ONNX_ATTENTION_OPSET)
    opts = GraphOptions(attention, quant, fuse_norms, kv.dtype, moe=moe, paged=paged, key_tiles=kv.key_tiles,
                        llmc_norms=fuse_norms and llmc_ops and dtype == "float32", llmc_recurrence=llmc_ops)
    graphs = {spec.file: (spec, *build_graph(ckpt, spec, dtype, opset, opts)) for spec in (prefill, decode)}
    domains = {MS: 1, LLMC_DOMAIN: 1} if llmc_ops else {MS: 1}
    weights = WeightFile(out / "weights.bin")
    try:
        for name in dict.fromkeys(n for _, _, used in graphs.values() for n in used):  # only what a graph reads
            weights.add(name, ckpt.weights[name])
        for spec, graph, used in graphs.values():
            onnx.save(make_model(graph, weights, used, opset, domains), str(out / spec.file))
    finally:
        weights.close()
    return kv, prefill, decode
