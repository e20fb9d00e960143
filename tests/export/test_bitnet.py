"""BitNet b1.58 as its ternary checkpoints ship (quantization_config "bitnet"): each of transformers' three forms of
its products (BitLinear's 2-bit packing, AutoBitLinear's offline and online forms) is exported as the float weights it
computes with, behind per-token int8 activations (ModelSpec.act_quant), and matches transformers; options llmc does
not build are refused by name; and a 4-bit engine of llmc's operator computes the model's own integer products."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import Built
from tiny_models import _as_published_bitnet, make_model

from llmc.engines.ort.build import build_ort
from llmc.engines.ort.config import BuildConfig, MatMul, Quant
from llmc.engines.registry import load_engine_dir
from llmc.errors import UnsupportedModelError
from llmc.export.exporter import ExportConfig, export
from llmc.graph import quant
from llmc.manifest import load_export

# A rounding turns a float-sized difference into a whole int8 step where its input x s lies at a tie (k + 1/2): llmc's
# inputs to each rounding were measured within 1.6e-4 of transformers' (in units of x s, 23-token prompts), so the
# sequences checked at 1e-4 are those whose every rounded value in transformers' forward lies at least this far from
# a tie; elsewhere the two may part by one step of one value (0.017 of the logits seen at 23 tokens).
MARGIN = 4e-4


def _reference_model(hf_dir: Path) -> Any:
    import torch
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    torch._dynamo.config.disable = True  # (its torch.compile'd helpers eagerly: as sources.load runs them)
    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()


def _forward(model: Any, ids: list[int]) -> tuple[np.ndarray, float]:
    """transformers' logits at every position of ids [S, V], and the least distance of a rounded value to a tie."""
    import torch

    from llmc.export.arch import BITNET_LINEARS

    margins: list[float] = [np.inf]  # (none: the bf16 master weights' network)

    def measure(module: Any, args: tuple[Any, ...]) -> None:
        x = args[0].float()
        xs = x * (127 / x.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5))
        margins.append(float((xs - xs.floor() - 0.5).abs().min()))

    hooks = [m.register_forward_pre_hook(measure) for m in model.modules() if type(m).__name__ in BITNET_LINEARS]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, min(margins)


def _sequences(model: Any, count: int = 2, length: int = 5) -> list[tuple[list[int], np.ndarray]]:
    """`count` random sequences whose rounded values all keep MARGIN from a tie, with transformers' logits."""
    found = []
    for seed in range(400):
        ids = np.random.default_rng(seed).integers(3, 320, size=length).tolist()
        logits, margin = _forward(model, ids)
        if margin >= MARGIN:
            found.append((ids, logits))
            if len(found) == count:
                return found
    raise AssertionError(f"fewer than {count} of 400 sequences keep {MARGIN} from every tie")


def _follows(engine_dir: Path, sequences: list[tuple[list[int], np.ndarray]]) -> float:
    """The largest difference from transformers over each sequence's prompt (its first 2 tokens) and its decode steps
    (the rest, teacher-forced)."""
    engine = load_engine_dir(engine_dir)
    worst = 0.0
    for ids, want in sequences:
        kv = engine.new_kv_cache(1, 64)
        got = [engine.prefill([0], [ids[:2]], kv)[0]] + [engine.decode([0], [[t]], kv)[0] for t in ids[2:]]
        worst = max(worst, *(float(np.abs(g - w).max()) for g, w in zip(got, want[1:])))
    return worst


@pytest.mark.parametrize(("linear_class", "mode"), [("autobitlinear", "offline"), ("bitlinear", "offline"),
                                                    ("autobitlinear", "online")])
def test_each_form_of_the_products_follows_transformers(tmp_path: Path, linear_class: str, mode: str) -> None:
    """An offline AutoBitLinear (as bitnet-b1.58-2B-4T ships), BitLinear's packing, and the online form, which
    rounds its master weights as it runs (llmc rounds them once, at export, the same way): GroupQueryAttention and
    llmc's attention engines over an fp32 cache follow transformers' prompt and decode steps to 1e-4."""
    hf_dir = make_model("bitnet", tmp_path / "hf")
    _as_published_bitnet(hf_dir, linear_class, mode)
    export(ExportConfig(model=str(hf_dir), out_dir=tmp_path / "export"))
    export_manifest = load_export(tmp_path / "export")
    m = export_manifest.model
    assert (m.sub_norms, m.act_quant, m.activation) == (True, "int8_token", "relu2")
    # the export's own check: its graphs without their rounding against transformers' products without theirs, and
    # the rounded graphs' figures beside (exporter._check_rounded); transformers' modules as they were after it
    parity = export_manifest.parity
    assert parity["max_abs_diff"] <= 1e-4 and parity["rounded_top1_agreement"] == 1.0
    assert not [f for f in (tmp_path / "export").iterdir() if f.name.startswith("unrounded")]
    from transformers.integrations import bitnet

    assert "apply" not in bitnet.ActQuant.__dict__ and bitnet.BitLinear.activation_quant.__name__ != "unrounded"
    sequences = _sequences(_reference_model(hf_dir))
    for attention in ("gqa", "llmc"):
        out = tmp_path / attention
        build_ort(BuildConfig(tmp_path / "export", out, force=True, attention=attention, kv_dtype="float32"))
        assert _follows(out, sequences) <= 1e-4, attention


def test_the_bf16_master_weights_are_the_network_without_rounding(tiny_factory: Callable[[str], Built],
                                                                   hf_factory: Callable[[Built], Any]) -> None:
    plain, ternary = (load_export(tiny_factory(a).export_dir).model for a in ("bitnet", "bitnet_ternary"))
    assert (plain.sub_norms, plain.act_quant) == (True, "")
    assert (ternary.sub_norms, ternary.act_quant) == (True, "int8_token")
    # the same master weights: rounding them and the activations moves the logits; the plain network follows
    # transformers at any prompt (no rounding to tie)
    ids = [5, 9, 33, 71, 100, 7, 12, 200, 150, 3, 44, 17]
    got = [_last(tiny_factory(a).engine("gqa"), ids) for a in ("bitnet", "bitnet_ternary")]
    assert float(np.abs(got[0] - got[1]).max()) > 1e-2
    want, _ = _forward(hf_factory(tiny_factory("bitnet")), ids)
    assert float(np.abs(got[0] - want[-1]).max()) <= 1e-4


def _last(engine_dir: Path, ids: list[int]) -> np.ndarray:
    engine = load_engine_dir(engine_dir)
    return engine.prefill([0], [ids], engine.new_kv_cache(1, 64))[0]


def _with_quantization(hf_dir: Path, **fields: Any) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"].update(fields)
    (hf_dir / "config.json").write_text(json.dumps(config))


def _float_product(hf_dir: Path, name: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(hf_dir / "model.safetensors"))
    packed = weights.pop(f"{name}.weight")
    del weights[f"{name}.weight_scale"]
    weights[f"{name}.weight"] = torch.randn(4 * packed.shape[0], packed.shape[1])
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})


def test_options_llmc_does_not_build_are_refused_by_name(tmp_path: Path) -> None:
    hf_dir = make_model("bitnet_ternary", tmp_path / "norm")
    _with_quantization(hf_dir, use_rms_norm=True)
    with pytest.raises(UnsupportedModelError, match=r"quantization_config.use_rms_norm = True is not supported"):
        export(ExportConfig(model=str(hf_dir), out_dir=tmp_path / "e1"))
    hf_dir = make_model("bitnet_ternary", tmp_path / "kept")  # (one product left in float, as transformers reads it)
    _with_quantization(hf_dir, modules_to_not_convert=["lm_head", "model.layers.1.mlp.down_proj"])
    _float_product(hf_dir, "model.layers.1.mlp.down_proj")
    with pytest.raises(UnsupportedModelError, match=r"modules_to_not_convert = 'model.layers.1.mlp.down_proj'"):
        export(ExportConfig(model=str(hf_dir), out_dir=tmp_path / "e2"))
    hf_dir = make_model("llama", tmp_path / "llama")  # (transformers' bitnet quantizer on another family)
    (hf_dir / "config.json").write_text(json.dumps({**json.loads((hf_dir / "config.json").read_text()),
                                                    "quantization_config": {"quant_method": "bitnet"}}))
    with pytest.raises(Exception, match=r"quant_method 'bitnet' is not supported"):
        export(ExportConfig(model=str(hf_dir), out_dir=tmp_path / "e3"))


def test_ternary_blocks_keep_zero_exact_on_every_grid() -> None:
    rng = np.random.default_rng(0)
    h = np.float32(0.0371)
    w = (rng.integers(-1, 2, size=(64, 48)) * h).astype(np.float32)  # [K, N], ternary times a scale
    w[:32, 5] = rng.normal(size=32)  # one block of floats: its usual grid
    w[32:, 7] = np.abs(w[32:, 7])  # blocks of 0 and h only, and of -h and 0 only (0 off the usual grids' steps)
    w[32:, 8] = -np.abs(w[32:, 8])
    back = {"q4 tiles": quant.unpack_q4_tiles(quant.pack_q4_tiles(w), 48),
            "q8 tiles": quant.unpack_q8_tiles(quant.pack_q8_tiles(w), 48),
            "minmax": quant.dequantize(quant.quantize(w, quant.QuantSpec(4, scheme="minmax")),
                                       quant.QuantSpec(4, scheme="minmax"))}
    ternary = np.ones_like(w, bool)
    ternary[:32, 5] = False
    for name, got in back.items():
        assert np.all(got[(w == 0) & ternary] == 0), name
        assert np.allclose(got[ternary], w[ternary], rtol=2 ** -11, atol=0), name
        assert np.abs(got[~ternary] - w[~ternary]).max() < 0.1 * np.abs(w[~ternary]).max(), name


def test_a_4_bit_engine_computes_the_model_s_integers(tiny_factory: Callable[[str], Built], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """llmc's 2-bit tiles hold the ternary weights as they are (MatMulQ2: a scale h and min -h a column, in fp32),
    and the 4-bit tiles on their own grid (scale h, exact in fp16 for an offline AutoBitLinear's bf16 scale); both
    round each row's input to int8 themselves (act_rows: the model's own integers), so with the head kept in fp32 the
    engine follows transformers to float32's sums; on the usual 4-bit grid (each 0 between two levels) it is not."""
    built = tiny_factory("bitnet_ternary")
    sequences = _sequences(_reference_model(built.hf_dir))
    config = BuildConfig(built.export_dir, tmp_path / "int4", force=True, quant=Quant.int4, matmul=MatMul.llmc,
                         layout=(("lm_head", "fp32"),))
    for op in ("MatMulQ2", "MatMulQ4"):
        build_ort(config)
        nodes = onnx.load(str(tmp_path / "int4" / "model.onnx"), load_external_data=False).graph.node
        products = [n for n in nodes if n.op_type == op]
        assert len(products) == 8 and all({a.name: a.i for a in n.attribute}.get("act_rows") == 1 for n in products)
        assert not [n for n in nodes if n.op_type == "Round"]  # (the operators round the inputs: no graph rounding)
        assert _follows(tmp_path / "int4", sequences) <= 1e-4, op
        monkeypatch.setattr(quant, "ternary_columns", lambda w, axis=0: False)  # (next: the 4-bit tiles)
    monkeypatch.setattr(quant, "ternary_blocks", lambda w, axis: (np.zeros(np.delete(w.shape, axis), bool),
                                                                  np.abs(w).max(axis=axis)))
    build_ort(BuildConfig(built.export_dir, tmp_path / "usual", force=True, quant=Quant.int4, matmul=MatMul.llmc,
                          layout=(("lm_head", "fp32"),), allow_divergence=True))
    assert _follows(tmp_path / "usual", sequences) > 1e-2


def test_the_precision_search_leaves_the_ternary_products_alone(tiny_factory: Callable[[str], Built]) -> None:
    """A BitNet product on ternary weights is exact at 4 bits and its input int8 as the model's: no raise brings it
    closer, so the search's only candidate is the head (the bf16 master weights' products are candidates)."""
    from llmc.engines.ort.graphs import load_checkpoint, quantizable
    from llmc.engines.ort.quality import gains_nothing

    for arch, candidates in (("bitnet_ternary", 0), ("bitnet", 8)):
        export_dir = tiny_factory(arch).export_dir
        ckpt = load_checkpoint(export_dir, load_export(export_dir))
        names = [n for n in quantizable(ckpt) if n != "lm_head.weight"]
        assert len(names) == 8 and sum(not gains_nothing(ckpt, n) for n in names) == candidates, arch



def test_a_bitnet_export_too_large_for_the_machine_is_refused_counting_its_copies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Export holds an offline BitNet checkpoint's decoder products once in fp32 (transformers' unpacked ternary
    weights become views of the graphs' own as each layer's are made: release.py), an online one's twice (its master
    weights stay): bitnet-b1.58-2B-4T's shapes need 9.0 and 16.8 GiB; on a machine with less the check before loading
    says so (before the scales were folded in place a third copy got it killed past 24 GB)."""
    import types

    import psutil

    from llmc.errors import InputError
    from llmc.export.config_check import check_config

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=16 * 2**30))
    config = {"model_type": "bitnet", "vocab_size": 128256, "hidden_size": 2560, "intermediate_size": 6912,
              "num_hidden_layers": 30, "num_attention_heads": 20, "num_key_value_heads": 5, "head_dim": 128,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
              "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
              "quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                      "quantization_mode": "offline"}}
    check_config(config, "config.json")  # (9.0 GiB: fits)
    online = {**config, "quantization_config": {**config["quantization_config"], "quantization_mode": "online"}}
    with pytest.raises(InputError, match=r"2\.41 B parameters, 16\.8 GiB in fp32 as export holds it, more than this "
                                         r"machine's 16\.0 GiB .*online BitNet checkpoint's decoder products twice in "
                                         r"fp32: its master weights and their rounded floats"):
        check_config(online, "config.json")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=8 * 2**30))
    with pytest.raises(InputError, match=r"2\.41 B parameters, 9\.0 GiB in fp32 as export holds it, more than this "
                                         r"machine's 8\.0 GiB of memory \(export holds the model in fp32\)"):
        check_config(config, "config.json")
