"""OLMo 2 and OLMo 3 GGUF files written as llama.cpp's `Olmo2Model` writes them (both as `olmo2`), read back by llmc
(gguf_archs/dense_llama_olmo2) to the logits of the checkpoint they came from; the OLMo 3 forms llmc cannot say what
llama.cpp computes from refused."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from gguf_files import TINY, _finish, _tokenizer, add_tensors, add_text_keys, add_yarn_keys, built, read_back

from llmc.errors import UnsupportedModelError


def write_olmo2(model: Any, folder: Path, out: Path, metadata: dict[str, Any] | None = None,
                more: dict[str, float] | None = None) -> Path:
    """`TextModel`'s keys: the rotary base and scaling of the full layers' table (yarn's type, factor, original
    context, attention factor and betas where the table has them), the RMS epsilon, the head size where the config
    has one; no tensor reordered. For an OLMo 3 checkpoint `Olmo2Model` adds its window and its layer types as the
    pattern. `metadata` replaces keys' values, `more` adds float keys (the files llmc must refuse)."""
    import gguf

    c = model.config
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w = gguf.GGUFWriter(str(out), "olmo2")
    add_text_keys(w, c)
    if rope.get("rope_type") == "yarn":
        add_yarn_keys(w, rope, ("attention_factor", "beta_fast", "beta_slow"))
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.to_dict().get("head_dim") is not None:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if c.model_type == "olmo3":
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    for key, value in (more or {}).items():
        w.add_float32(key, value)
    _tokenizer(w, folder, c.vocab_size)
    add_tensors(w, model, gguf.MODEL_ARCH.OLMO2)
    _finish(w, (), metadata)
    return out


def _olmo2(tmp: Path) -> tuple[Any, Path]:
    import transformers as tf

    return built(tmp, "olmo2", tf.Olmo2ForCausalLM(tf.Olmo2Config(**TINY, rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0})))


def _olmo3(tmp: Path, yarn: bool = True, attention_factor: bool = True) -> tuple[Any, Path]:
    """OLMo 3's form: three sliding layers then a full one (5 layers), a window of 8 over 100 positions, yarn 8 on
    the full layers from a context of 32 (OLMo 3's attention factor, 0.1 ln 8 + 1, as its checkpoints give it)."""
    import transformers as tf

    full: dict[str, Any] = {"rope_type": "default", "rope_theta": 500000.0}
    if yarn:
        full = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0,
                **({"attention_factor": 0.1 * math.log(8.0) + 1.0} if attention_factor else {})}
    config = tf.Olmo3Config(**{**TINY, "num_hidden_layers": 5}, sliding_window=8, rope_parameters={
        "full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention", "sliding_attention"]
    return built(tmp, "olmo3", tf.Olmo3ForCausalLM(config))


CASES = {"olmo2": _olmo2,
         "olmo3 (yarn, attention factor)": _olmo3,
         "olmo3 (yarn)": lambda tmp: _olmo3(tmp, attention_factor=False),
         "olmo3 (no scaling)": lambda tmp: _olmo3(tmp, yarn=False)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_olmo2_gguf_is_the_model_it_came_from(tmp_path: Path, name: str) -> None:
    hf, folder = CASES[name](tmp_path)
    hf.set_attn_implementation("eager")
    assert read_back(hf, write_olmo2(hf, folder, tmp_path / "model.gguf")) <= 1e-4


def test_an_olmo3_gguf_reads_as_olmo3(tmp_path: Path) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _olmo3(tmp_path)
    ours = load(resolve(str(write_olmo2(hf, folder, tmp_path / "model.gguf")))).model
    c = ours.config
    assert (c.model_type, c.sliding_window, c.layer_types) == ("olmo3", 8, hf.config.layer_types)
    assert c.rope_parameters["sliding_attention"]["rope_type"] == "default"
    assert (c.rope_parameters["full_attention"]["rope_type"], c.rope_parameters["full_attention"]["factor"]) == \
        ("yarn", 8.0)


@pytest.mark.parametrize(("metadata", "more", "match"), [
    ({"olmo2.attention.sliding_window_pattern": [True, False, True, False, True]}, {},
     "sliding_window_pattern .* not the period of 4"),
    ({"olmo2.rope.scaling.yarn_attn_factor": 1.5}, {}, "yarn_attn_factor 1.5"),
    ({"olmo2.rope.scaling.yarn_beta_fast": 16.0}, {}, "yarn_beta_fast 16.0"),
    ({}, {"olmo2.rope.scaling.attn_factor": 0.1 * math.log(8.0) + 1.0}, "rope.scaling.attn_factor"),
    ({}, {"olmo2.rope.freq_base_swa": 10000.0}, "rope.freq_base_swa 10000.0"),
])
def test_an_olmo3_gguf_llmc_cannot_express_is_refused(tmp_path: Path, metadata: dict[str, Any],
                                                      more: dict[str, float], match: str) -> None:
    from llmc.export.sources import load, resolve

    hf, folder = _olmo3(tmp_path)
    path = write_olmo2(hf, folder, tmp_path / "model.gguf", metadata=metadata, more=more)
    with pytest.raises(UnsupportedModelError, match=match):
        load(resolve(str(path)))
