"""`llmc export`: a model reference in, an export folder out (graphs, weights once, manifest, golden)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from llmc.errors import InputError, LlmcError, UnsupportedModelError, one_line
from llmc.export import sources
from llmc.export.arch import from_transformers
from llmc.export.golden import golden_prompt_ids, make_golden
from llmc.golden import GOLDEN_FILE, GOLDEN_STEPS, Golden
from llmc.graph import io_names
from llmc.graph.checkpoint import ROPE_TABLES, Checkpoint
from llmc.graph.decoder import build_graph
from llmc.graph.moe import float32_weights
from llmc.manifest import ExportManifest, GenerationSpec, GraphSpec, save, sha256_file
from llmc.onnx_store import WeightFile, make_model
from llmc.outdir import atomic_dir, check_out_dir
from llmc.progress import Progress, Quiet

SUPPORTED_OPSETS = range(17, 22)
WEIGHTS_FILE = "weights.bin"
# fp32 graphs must match transformers this closely or the export is refused; fp16 is checked by top-1 only.
FP32_TOLERANCE = 1e-3
STEPS = 7


@dataclass(frozen=True)
class ExportConfig:
    model: str
    out_dir: Path
    dtype: str = "float32"
    opset: int = 17
    force: bool = False
    allow_pickle: bool = False


def check_config(cfg: ExportConfig) -> None:
    if cfg.dtype not in ("float32", "float16"):
        raise InputError(f"--dtype must be float32 or float16, got {cfg.dtype!r}")
    if cfg.opset not in SUPPORTED_OPSETS:
        raise InputError(f"--opset must be in [{SUPPORTED_OPSETS.start}, {SUPPORTED_OPSETS.stop - 1}], got {cfg.opset}")
    check_out_dir(cfg.out_dir, cfg.force)


def export(cfg: ExportConfig, progress: Progress | None = None) -> ExportManifest:
    """Export into a temporary folder beside OUT_DIR, then move it into place: never a half-written export."""
    progress = progress or Quiet()
    check_config(cfg)
    progress.step(f"resolving {cfg.model}")
    src = sources.resolve(cfg.model, cfg.allow_pickle)
    with atomic_dir(cfg.out_dir, src.path, "model") as work:
        return _export_into(work, src, cfg, progress)


def _export_into(work: Path, src: sources.ModelSource, cfg: ExportConfig, progress: Progress) -> ExportManifest:
    progress.step(f"loading {src.name} ({src.kind}) with transformers")
    loaded = sources.load(src)
    ckpt = from_transformers(loaded.model)
    kv = io_names.kv_spec(ckpt.spec, cfg.dtype)
    graphs = {"prefill": io_names.prefill_spec(ckpt.spec, kv), "decode": io_names.decode_spec(ckpt.spec, kv)}
    progress.step(f"writing weights ({_nbytes(ckpt, cfg.dtype) / 1e6:.0f} MB, stored once) and graphs")
    _write_graphs(work, ckpt, graphs, cfg)
    progress.step("copying tokenizer, chat template and generation config")
    generation = _write_tokenizer(work, loaded)
    progress.step("computing golden outputs with transformers")
    prompt = golden_prompt_ids(loaded.tokenizer)
    if len(prompt) + GOLDEN_STEPS > ckpt.spec.max_positions:  # (the export checks its graphs on this prompt)
        raise InputError(f"max_position_embeddings {ckpt.spec.max_positions} is less than the golden check needs "
                         f"({len(prompt)} prompt tokens + {GOLDEN_STEPS}): the model cannot hold a chat turn")
    try:
        golden = make_golden(loaded.model, prompt)
    except Exception as e:  # (a config transformers builds but cannot run: its own error, in one line)
        raise UnsupportedModelError(f"transformers' own forward fails on this model's config, and llmc checks every "
                                    f"export against it: {type(e).__name__}: {one_line(e)}") from None
    golden.save(work / GOLDEN_FILE)
    manifest = ExportManifest(
        model_name=src.name, source=str(src.path), dtype=cfg.dtype, opset=cfg.opset, model=ckpt.spec, kv=kv,
        prefill=graphs["prefill"], decode=graphs["decode"], generation=generation, weights_file=WEIGHTS_FILE,
        golden_file=GOLDEN_FILE, tools=tool_versions(), files={},
    )
    progress.step("checking the graphs against transformers (ONNX Runtime)")
    if ckpt.spec.act_quant:
        parity = _check_rounded(work, manifest, golden, loaded.model, prompt, ckpt, cfg.opset)
    else:
        parity = _check_parity(work, manifest, golden, loaded.model)
    progress.step("writing manifest")
    files = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file()}
    manifest = ExportManifest(**{**manifest.__dict__, "files": files, "parity": parity})
    save(manifest, work)
    return manifest


def _nbytes(ckpt: Checkpoint, dtype: str) -> int:
    itemsize = 2 if dtype == "float16" else 4
    return sum(w.size for w in ckpt.weights.values()) * itemsize


def _write_graphs(work: Path, ckpt: Checkpoint, graphs: dict[str, GraphSpec], cfg: ExportConfig) -> None:
    weights = WeightFile(work / WEIGHTS_FILE)
    np_dtype = np.float16 if cfg.dtype == "float16" else np.float32
    routers = float32_weights(ckpt.spec)  # (GLM-4.5's: transformers keeps them in fp32)
    try:
        for name, array in ckpt.weights.items():
            weights.add(name, array if name in ROPE_TABLES or name in routers else array.astype(np_dtype, copy=False))
    finally:
        weights.close()
    for spec in graphs.values():
        graph, used = build_graph(ckpt, spec, cfg.dtype, cfg.opset)
        model = make_model(graph, weights, used, cfg.opset)
        path = work / spec.file
        onnx.save(model, str(path))
        onnx.checker.check_model(str(path))  # path form: works past 2 GB, checks external data


def _write_tokenizer(work: Path, loaded: sources.LoadedModel) -> GenerationSpec:
    tok = loaded.tokenizer
    tok.save_pretrained(str(work))
    if not (work / "tokenizer.json").is_file():
        raise LlmcError(f"{loaded.source.name}: no fast tokenizer (tokenizer.json) could be made for the runtime")
    for extra in ("special_tokens_map.json",):
        (work / extra).unlink(missing_ok=True)
    gen = loaded.model.generation_config
    gen.save_pretrained(str(work))
    eos = gen.eos_token_id if gen.eos_token_id is not None else tok.eos_token_id
    eos_ids = tuple(sorted({int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}))
    return GenerationSpec(
        eos_token_ids=eos_ids,
        bos_token_id=gen.bos_token_id,
        pad_token_id=gen.pad_token_id,
        has_chat_template=bool(getattr(tok, "chat_template", None)),
    )


def _check_parity(work: Path, manifest: ExportManifest, golden: Golden, model: object) -> dict[str, float]:
    """The export's graphs teacher-forced on the golden sequence against transformers' fp32 logits: within
    FP32_TOLERANCE, or else (a model whose fp32 arithmetic itself moves its logits that far: a large residual stream)
    no further from transformers' float64 logits than max(FP32_TOLERANCE, 2x transformers' own fp32 error)."""
    from llmc.engines.ort.build import export_engine
    from llmc.runtime.verify import check_golden

    engine = export_engine(manifest, work)
    result = check_golden(engine, golden)
    if not math.isfinite(result["max_abs_diff"]):  # NaN compares false with any tolerance
        raise LlmcError(f"the logits are not finite (max |logit diff| {result['max_abs_diff']}): the model computes "
                        "NaN or inf from these weights and this config")
    if manifest.dtype == "float32" and result["max_abs_diff"] > FP32_TOLERANCE:
        exact = _float64_logits(model, golden)
        if exact is None:
            raise LlmcError(f"exported graphs differ from transformers: max |logit diff| {result['max_abs_diff']:.2e} "
                            f"> {FP32_TOLERANCE:.0e} (transformers' own fp32 error could not be measured: the model "
                            "does not run in float64, or its float64 copy would not fit in half the free memory)")
        own = float(np.abs(golden.logits.astype(np.float64) - exact).max())
        ours = check_golden(engine, Golden(golden.input_ids, golden.continuation, exact))["max_abs_diff"]
        limit = max(FP32_TOLERANCE, 2 * own)
        if not ours <= limit:
            raise LlmcError(f"exported graphs differ from transformers: max |logit diff| {result['max_abs_diff']:.2e} "
                            f"> {FP32_TOLERANCE:.0e}, and {ours:.2e} from its float64 logits, where its own fp32 "
                            f"logits are {own:.2e} from them (at most {limit:.2e} allowed)")
        result.update(float64_diff=ours, transformers_fp32_error=own)
    return result


def _check_rounded(work: Path, manifest: ExportManifest, golden: Golden, model: object, prompt: list[int],
                   ckpt: Checkpoint, opset: int) -> dict[str, float]:
    """A model that rounds its products' inputs to int8 (ModelSpec.act_quant: BitNet). A rounding parts two fp32
    computations of it by one int8 step of one value wherever that value lies at a tie (k + 1/2), and at billions of
    parameters some always does: so its graphs are checked as every export's with the rounding taken out on both
    sides (the same graphs, every weight, norm and attention, but for the rounding, and transformers' products on
    their inputs as they are), and the rounded graphs' figures against the golden outputs (the model as it is) are
    recorded beside, under "rounded_". The rounding itself: tests/export/test_bitnet.py."""
    from llmc.engines.ort.build import export_engine
    from llmc.export.arch import without_rounding
    from llmc.runtime.verify import check_golden

    plain = replace(manifest.model, act_quant="")
    files = {kind: replace(getattr(manifest, kind), file=f"unrounded-{getattr(manifest, kind).file}")
             for kind in ("prefill", "decode")}
    for kind, spec in files.items():  # (their weights: the rounded graphs' own, in the same weights file)
        placed = {t.name: t for t in onnx.load(str(work / getattr(manifest, kind).file),
                                               load_external_data=False).graph.initializer}
        graph, used = build_graph(Checkpoint(plain, ckpt.weights), spec, manifest.dtype, opset)
        onnx.save(make_model(graph, placed, used, opset), str(work / spec.file))
    try:
        with without_rounding():
            result = _check_parity(work, replace(manifest, model=plain, **files), make_golden(model, prompt), model)
    finally:
        for spec in files.values():
            (work / spec.file).unlink()
    rounded = check_golden(export_engine(manifest, work), golden)
    return {**result, **{f"rounded_{k}": v for k, v in rounded.items()}}


def _float64_logits(model: object, golden: Golden) -> np.ndarray | None:
    """transformers' logits of the golden sequence computed in float64 (a copy of the model), or None where the copy
    would take more than half the free memory or the model does not run in float64."""
    import copy

    import psutil
    import torch

    params = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
    if 12 * params > psutil.virtual_memory().available // 2:  # (the fp32 copy, then its float64 form)
        return None
    ids = torch.tensor(np.concatenate([golden.input_ids, golden.continuation])[None, :], dtype=torch.long)
    try:
        exact = copy.deepcopy(model).double()  # type: ignore[attr-defined]
        with torch.no_grad():
            logits = exact(ids).logits[0, len(golden.input_ids) - 1:]
    except Exception:  # (kernels without a float64 form: transformers' grouped expert products, ...)
        return None
    return logits.numpy().astype(np.float64)  # type: ignore[no-any-return]


def tool_versions() -> dict[str, str]:
    import onnxruntime
    import torch
    import transformers

    import llmc

    versions = {"llmc": llmc.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
    try:
        import gguf

        versions["gguf"] = getattr(gguf, "__version__", "installed")
    except ImportError:
        pass
    return versions
