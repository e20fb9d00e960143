"""BitNet b1.58 as its ternary checkpoints ship (quantization_config "bitnet"): each of transformers' three forms of
its products (BitLinear's 2-bit packing, AutoBitLinear's offline and online forms) is exported as the float weights it
computes with, behind per-token int8 activations (ModelSpec.act_quant), and matches transformers; options llmc does
not build are refused by name; and a 4-bit engine holds the ternary weights on their own grid (0 exact), where the
usual (max - min) / 15 grid fails the build's golden check."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
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

IDS = [5, 9, 33, 71, 100, 7, 12, 200, 150, 3, 44, 17]


def _reference(hf_dir: Path) -> np.ndarray:
    import torch
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    torch._dynamo.config.disable = True  # (its torch.compile'd helpers eagerly: as sources.load runs them)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0, -1].numpy()


def _prefill(engine_dir: Path) -> np.ndarray:
    engine = load_engine_dir(engine_dir)
    return engine.prefill([0], [IDS], engine.new_kv_cache(1, 64))[0]


@pytest.mark.parametrize(("linear_class", "mode"), [("autobitlinear", "offline"), ("autobitlinear", "online")])
def test_each_form_of_the_products_matches_transformers(tmp_path: Path, linear_class: str, mode: str) -> None:
    """(BitLinear's packing: the parity suite's bitnet_ternary.) The online form rounds its master weights as it
    runs; llmc rounds them once, at export, the same way."""
    hf_dir = make_model("bitnet", tmp_path / "hf")
    _as_published_bitnet(hf_dir, linear_class, mode)
    export(ExportConfig(model=str(hf_dir), out_dir=tmp_path / "export"))
    m = load_export(tmp_path / "export").model
    assert (m.sub_norms, m.act_quant, m.activation) == (True, "int8_token", "relu2")
    build_ort(BuildConfig(tmp_path / "export", tmp_path / "engine", force=True, kv_dtype="float32"))
    want = _reference(hf_dir)
    assert float(np.abs(_prefill(tmp_path / "engine") - want).max()) <= 1e-4


def test_the_bf16_master_weights_are_the_network_without_rounding(tiny_factory: Callable[[str], Built],
                                                                   hf_factory: Callable[[Built], Any]) -> None:
    plain, ternary = (load_export(tiny_factory(a).export_dir).model for a in ("bitnet", "bitnet_ternary"))
    assert (plain.sub_norms, plain.act_quant) == (True, "")
    assert (ternary.sub_norms, ternary.act_quant) == (True, "int8_token")
    # the same master weights: rounding them and the activations moves the logits
    got = [_prefill(tiny_factory(a).engine("gqa")) for a in ("bitnet", "bitnet_ternary")]
    assert float(np.abs(got[0] - got[1]).max()) > 1e-2


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


def test_a_4_bit_engine_holds_the_ternary_weights(tiny_factory: Callable[[str], Built], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """llmc's 4-bit tiles pass the build's golden check on the ternary grid; on the usual one (each 0 between two
    levels: h / 15 off) the same build is refused."""
    built = tiny_factory("bitnet_ternary")
    fp32 = _prefill(built.engine("gqa"))
    config = BuildConfig(built.export_dir, tmp_path / "int4", force=True, quant=Quant.int4, matmul=MatMul.llmc)
    build_ort(config)
    assert float(np.abs(_prefill(tmp_path / "int4") - fp32).max()) < 0.05 * float(np.abs(fp32).max())
    monkeypatch.setattr(quant, "ternary_blocks", lambda w, axis: np.zeros(np.delete(w.shape, axis), bool))
    with pytest.raises(Exception, match="greedy continuation of the golden prompt leaves the model's"):
        build_ort(BuildConfig(built.export_dir, tmp_path / "usual", force=True, quant=Quant.int4,
                              matmul=MatMul.llmc))
