"""FlexOlmo GGUF files as llama.cpp's `FlexOlmoModel` writes them, read back to the logits of the checkpoint (or, where
the file does not carry the checkpoint's routing or epsilon, of the model llama.cpp computes from it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, add_keys, built, read_back

from llmc.errors import UnsupportedModelError

from .test_gguf_archs_moe_common import text_keys, write_moe


def write_flex_olmo(model: Any, folder: Path, out: Path, more: dict[str, Any] | None = None,
                    leave_out: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None) -> Path:
    """`OlmoeModel.set_gguf_parameters`: `TextModel`'s keys, the RMS epsilon then overwritten with 1e-5; the tensors
    as they are (q / k not permuted), the router as `ffn_gate_inp`, the experts stacked per projection, the rest by
    OLMo 2's name table (gguf's package has none for `flex_olmo`). `more` adds keys by the writer's calls
    (`add_keys`), `leave_out` drops keys or tensors, `extra` adds tensors: the files llmc must refuse."""
    def keys(w: Any, h: dict[str, Any]) -> None:
        text_keys(w, h)
        w.add_layer_norm_rms_eps(1e-5)
        add_keys(w, **(more or {}))
        for name, values in (extra or {}).items():
            w.add_tensor(name, values)

    def transform(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
        if name.endswith("mlp.gate.weight"):
            return [(f"blk.{name.split('.')[2]}.ffn_gate_inp.weight", values)]
        return None

    return write_moe(model, folder, out, "flex_olmo", keys, transform, leave_out=leave_out, table="olmo2")


def _flex_olmo(tmp: Path, rope: dict[str, Any] | None = None, **fields: Any) -> tuple[Any, Path]:
    """FlexOlmo's form at a tiny size: grouped KV heads, 8 experts 24 wide, top-2 over the softmax, not renormalized;
    RMS epsilon 1e-5 (the file's, whatever the checkpoint's) unless `fields` say otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "flex_olmo", **{**TINY, "intermediate_size": 24}, num_experts=8, num_experts_per_tok=2,
        **{"rms_norm_eps": 1e-5, **fields}, rope_parameters=rope or {"rope_type": "default", "rope_theta": 5e5})
    name = f"flex_olmo_{(rope or {}).get('rope_type', 'default')}_{sorted(fields.items())}"
    return built(tmp, name, AutoModelForCausalLM.from_config(config))


ROPES = {"default": None, "linear": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0},
         "yarn": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 64,
                  "beta_fast": 32.0, "beta_slow": 1.0}}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_flex_olmo_reads_back_as_its_checkpoint(tmp_path: Path, rope: str) -> None:
    hf, folder = _flex_olmo(tmp_path, ROPES[rope])
    assert read_back(hf, write_flex_olmo(hf, folder, tmp_path / "flex.gguf")) <= 1e-4


def test_flex_olmo_reads_as_llama_cpp_computes_what_the_file_does_not_say(tmp_path: Path) -> None:
    """A checkpoint renormalizing its chosen experts' weights with FlexOlmo's own epsilon 1e-6: the converter writes
    neither (its epsilon is 1e-5), and llama.cpp never renormalizes, so the file is that model; routing keys saying
    what llama.cpp computes change nothing."""
    import gguf
    from transformers import AutoModelForCausalLM

    from llmc.export.sources import load, resolve

    hf, folder = _flex_olmo(tmp_path, norm_topk_prob=True, rms_norm_eps=1e-6)
    path = write_flex_olmo(hf, folder, tmp_path / "flex.gguf", more={
        "expert_gating_func": gguf.ExpertGatingFuncType.SOFTMAX, "expert_weights_norm": False,
        "expert_weights_scale": 1.0})
    computed = AutoModelForCausalLM.from_config(type(hf.config)(**{**hf.config.to_dict(), "norm_topk_prob": False,
                                                                   "rms_norm_eps": 1e-5}))
    computed.load_state_dict(hf.state_dict())
    c = load(resolve(str(path))).model.config
    assert (c.model_type, c.norm_topk_prob, c.rms_norm_eps) == ("flex_olmo", False, pytest.approx(1e-5))
    assert read_back(computed.eval(), path) <= 1e-4 < read_back(hf, path)


@pytest.mark.parametrize(("more", "leave_out", "extra", "match"), [
    ({"key_length": 32}, (), {}, "attention.key_length 32"),
    ({"value_length": 32}, (), {}, "attention.value_length 32"),
    ({"rope_dimension_count": 8}, (), {}, "rope.dimension_count 8"),
    ({"expert_gating_func": 2}, (), {}, "expert_gating_func 2"),
    ({"expert_weights_norm": True}, (), {}, "expert_weights_norm True"),
    ({"expert_weights_scale": 2.5}, (), {}, "expert_weights_scale 2.5"),
    ({}, ("output.weight",), {}, "no output.weight"),
    ({}, (), {"rope_freqs.weight": np.ones(8, dtype=np.float32)}, "rope_freqs.weight")])
def test_flex_olmo_files_llama_cpp_reads_otherwise_are_refused(tmp_path: Path, more: dict[str, Any],
                                                               leave_out: tuple[str, ...],
                                                               extra: dict[str, np.ndarray], match: str) -> None:
    import gguf

    hf, folder = _flex_olmo(tmp_path)
    more = {k: gguf.ExpertGatingFuncType(v) if k == "expert_gating_func" else v for k, v in more.items()}
    path = write_flex_olmo(hf, folder, tmp_path / "flex.gguf", more=more, leave_out=leave_out, extra=extra)
    with pytest.raises(UnsupportedModelError, match=match):
        read_back(hf, path)
