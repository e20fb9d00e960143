"""GLM-5 / GLM-5.1 / GLM-5.2 (`glm-dsa`) and DeepSeek-V3.2 (`deepseek32`) GGUF files as llama.cpp's
`GlmMoeDsaModel` / `DeepseekV32Model` write them, read back to the logits of the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_files import TINY, built, read_back

from llmc.errors import UnsupportedModelError

from . import test_gguf_archs_moe_deepseek2 as deepseek2


def write_dsa(model: Any, folder: Path, out: Path, arch: str, scoring: str | None = None, nextn: int = 1,
              types: bool = True, metadata: dict[str, Any] | None = None) -> Path:
    """`DeepseekV2Model`'s file (`write_deepseek2`, whose subclasses both converters are) as they extend it:
    `block_count` counting `nextn` NextN blocks (their tensors written after the model's: a latent-attention layer
    and the NextN projection / norms), `rope.dimension_count` again (GLM's: x partial_rotary_factor),
    `nextn_predict_layers`, the indexer's head count, key length and top-k, and (GLM, where the checkpoint's
    config.json has them: `types`) its `indexer_types` as one boolean per layer, true where `full`; the indexer's
    tensors under gguf's names as they are. `scoring`: config.json's scoring_func (None: none, as transformers'
    config has); deepseek32's tensors follow glm-dsa's name table."""
    c = model.config
    rng = np.random.default_rng(0)
    h_, e, i_ = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    mtp = (("attn_norm.weight", (h_,)), ("attn_q_a.weight", (c.q_lora_rank, h_)),
           ("attn_kv_a_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h_)),
           ("indexer.attn_k.weight", (c.index_head_dim, h_)), ("ffn_gate_inp.weight", (e, h_)),
           ("exp_probs_b.bias", (e,)), ("ffn_gate_exps.weight", (e, i_, h_)), ("ffn_down_exps.weight", (e, h_, i_)),
           ("nextn.eh_proj.weight", (h_, 2 * h_)), ("nextn.enorm.weight", (h_,)), ("nextn.hnorm.weight", (h_,)),
           ("nextn.shared_head_norm.weight", (h_,)))

    def dsa_keys(w: Any, h: dict[str, Any]) -> None:
        if arch == "glm-dsa":
            partial = (h.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
            w.add_rope_dimension_count(int(h["qk_rope_head_dim"] * partial))
        w.add_nextn_predict_layers(nextn)
        w.add_indexer_head_count(h["index_n_heads"])
        w.add_indexer_key_length(h["index_head_dim"])
        w.add_indexer_top_k(h["index_topk"])
        if arch == "glm-dsa" and types:
            w.add_array(f"{arch}.attention.indexer.types", [t == "full" for t in h["indexer_types"]])
        for n in range(c.num_hidden_layers, c.num_hidden_layers + nextn):  # (llama.cpp never runs them)
            for name, shape in mtp:
                w.add_tensor(f"blk.{n}.{name}", rng.standard_normal(shape).astype(np.float32))

    return deepseek2.write_deepseek2(model, folder, out, scoring, metadata, arch=arch, table="glm-dsa",
                                     appended=nextn, more_keys=dsa_keys)


# the indexer: 4 heads of twice the rotated dims (8), picking 16 of the 100 positions read back
DSA = dict(q_lora_rank=40, index_n_heads=4, index_head_dim=16, index_topk=16, routed_scaling_factor=1.5)


def _dsa(tmp: Path, cls: str, layers: int, **extra: Any) -> tuple[Any, Path]:
    """A tiny `cls` (GlmMoeDsa / DeepseekV32) of DeepSeek-V2's test sizes with the indexer, a selection bias."""
    import torch
    import transformers as tf

    config = getattr(tf, f"{cls}Config")(**{**TINY, "num_hidden_layers": layers, "num_key_value_heads": 4,
                                             **deepseek2.MLA, **DSA, **extra})
    model = getattr(tf, f"{cls}ForCausalLM")(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    return built(tmp, config.model_type, model)


GLM52 = dict(indexer_types=["full", "shared", "full", "shared", "shared"])
GLM52_UNTYPED = dict(index_topk_freq=4, index_skip_topk_offset=3, max_position_embeddings=1 << 20)


@pytest.mark.parametrize("layers, extra, types", [
    pytest.param(5, GLM52, True, id="glm-5.2"),  # the converter writes config.json's types
    pytest.param(3, {"norm_topk_prob": False}, False, id="glm-5"),  # no types, a 200k context: every layer full
    pytest.param(7, GLM52_UNTYPED, False, id="glm-5.2-untyped"),  # a 1M context: llama.cpp's GLM-5.2 pattern
])
def test_glm_moe_dsa_reads_back_as_its_checkpoint(tmp_path: Path, layers: int, extra: dict[str, Any],
                                                   types: bool) -> None:
    from llmc.export.gguf_read import config_for

    hf, folder = _dsa(tmp_path, "GlmMoeDsa", layers, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      **extra)
    path = write_dsa(hf, folder, tmp_path / "glm.gguf", "glm-dsa", types=types)
    config = config_for(path)
    assert config.num_hidden_layers == layers and config.indexer_types == hf.config.indexer_types
    assert read_back(hf, path) <= 1e-4


def test_deepseek_v32_reads_back_as_its_checkpoint(tmp_path: Path) -> None:
    """V3.2's form: sigmoid routing in groups, renormalized and scaled, yarn with its log multiplier."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf, folder = _dsa(tmp_path, "DeepseekV32", 3, n_group=4, topk_group=2, norm_topk_prob=True,
                      rope_parameters=rope)
    assert read_back(hf, write_dsa(hf, folder, tmp_path / "v32.gguf", "deepseek32", "sigmoid")) <= 1e-4


def test_dsa_files_transformers_cannot_express_are_refused(tmp_path: Path) -> None:
    from llmc.export.gguf_read import config_for

    hf, folder = _dsa(tmp_path, "GlmMoeDsa", 5, **GLM52)
    for key, value in (("expert_gating_func", 1), ("attention.indexer.key_length", 24),
                       ("attention.indexer.types", [False, True, True, True, True]),
                       ("attention.indexer.types", [True] * 6)):
        path = write_dsa(hf, folder, tmp_path / "bad.gguf", "glm-dsa", "sigmoid",
                         metadata={f"glm-dsa.{key}": value})
        with pytest.raises(UnsupportedModelError, match=key.replace(".", r"\.")):
            config_for(path)
    v32 = write_dsa(hf, folder, tmp_path / "v32.gguf", "deepseek32", "softmax")  # (refused before any weight)
    with pytest.raises(UnsupportedModelError, match="expert_gating_func"):
        config_for(v32)


def test_glm_moe_dsa_yarn_log_multiplier_is_refused(tmp_path: Path) -> None:
    """llama.cpp's glm-dsa does not read it: its q.k scale is not transformers'."""
    from llmc.export.gguf_read import config_for

    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    hf, folder = _dsa(tmp_path, "GlmMoeDsa", 2, rope_parameters=rope)
    with pytest.raises(UnsupportedModelError, match="yarn_log_multiplier"):
        config_for(write_dsa(hf, folder, tmp_path / "glm.gguf", "glm-dsa"))
