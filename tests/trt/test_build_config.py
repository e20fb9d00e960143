"""The pure-Python parts of `llmc build --backend trt`: config checks, settings, fp32 layer choice (CPU only; the
TensorRT calls themselves run in tests/trt/test_trt_engine.py where TensorRT imports)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from llmc.engines.ort.build import BuildConfig
from llmc.engines.trt.build import (
    TrtBuildConfig,
    build_trt,
    check_alignment,
    check_tensorrt,
    check_trt_config,
    default_limits,
    fp16_checkpoint,
    trt_config_from,
    trt_settings,
    version_tuple,
)
from llmc.engines.trt.profiles import TrtLimits, plan_profiles
from llmc.errors import BackendUnavailableError, InputError, LimitError
from llmc.graph import io_names as io
from llmc.graph.checkpoint import INV_FREQ, Checkpoint

from .test_profiles import MODEL

HAS_TRT = importlib.util.find_spec("tensorrt") is not None


def test_config_from_a_build_config_keeps_it_whole() -> None:
    base = BuildConfig(Path("export"), Path("engine"), backend="trt", force=True)
    cfg = trt_config_from(base, TrtLimits(max_batch_size=64), attention="native")
    assert cfg.backend == "trt" and cfg.base is base and cfg.out_dir == Path("engine")
    assert cfg.limits_for(MODEL).max_batch_size == 64 and cfg.attention == "native"


def test_default_limits_follow_the_model() -> None:
    assert default_limits(MODEL) == TrtLimits(8, 512, 2048, None)
    tiny = replace(MODEL, max_positions=256)
    assert default_limits(tiny) == TrtLimits(8, 256, 256, None)
    odd = replace(MODEL, max_positions=1000)
    assert default_limits(odd).max_seq_len == 896  # a multiple of 128: aligned KV slot rows


@pytest.mark.parametrize("change, error, match", [
    ({"precision": "fp32"}, InputError, r"--precision must be fp16 for --backend trt, got 'fp32'"),
    ({"attention": "gqa"}, InputError, r"--attention must be plugin or native for --backend trt, got 'gqa'"),
    ({"limits": TrtLimits(max_seq_len=16384)}, LimitError, r"--max-seq-len 16384 exceeds the model's 8192"),
])
def test_config_errors_name_value_and_limit(change: dict, error: type, match: str) -> None:
    cfg = replace(TrtBuildConfig(BuildConfig(Path("e"), Path("o"))), **change)
    with pytest.raises(error, match=match):
        check_trt_config(cfg, MODEL)


def test_quantized_weights_are_refused() -> None:
    with pytest.raises(InputError, match=r"--quant int4 is for --backend ort"):
        check_trt_config(TrtBuildConfig(BuildConfig(Path("e"), Path("o"), quant="int4")), MODEL)


def test_attention_sinks_are_refused_naming_the_other_backend() -> None:
    with pytest.raises(InputError, match=r"attention sinks \(GPT-OSS\).*build it with --backend ort"):
        check_trt_config(TrtBuildConfig(BuildConfig(Path("e"), Path("o"))), replace(MODEL, attn_sinks=True))


def test_latent_attention_is_refused_naming_the_other_backend() -> None:
    mla = replace(MODEL, num_kv_heads=1, head_dim=576, rotary_dim=64, mla_kv_rank=512, mla_nope_dim=128,
                  mla_v_dim=128)
    with pytest.raises(InputError, match=r"latent attention \(\d+ query heads on one KV head of 576 dims\).*"
                                         r"build it with --backend ort"):
        check_trt_config(TrtBuildConfig(BuildConfig(Path("e"), Path("o"))), mla)


def test_chunked_attention_is_refused_by_the_plugin_and_built_natively() -> None:
    chunked = replace(MODEL, attention_chunk=64, layer_types=("chunked_attention",) * MODEL.num_layers)
    with pytest.raises(InputError, match=r"chunked attention \(blocks of 64 positions: Llama 4\).*--attention native"):
        check_trt_config(TrtBuildConfig(BuildConfig(Path("e"), Path("o"))), chunked)
    check_trt_config(TrtBuildConfig(BuildConfig(Path("e"), Path("o")), attention="native"), chunked)


@pytest.mark.parametrize("kind", ["conv", "linear_attention", "mamba", "hybrid"])
def test_layers_with_states_are_refused_naming_the_other_backend(kind: str) -> None:
    states = replace(MODEL, conv_kernel=3, linear_conv_kernel=4, mamba_conv_kernel=4,
                     layer_types=(kind,) + ("full_attention",) * (MODEL.num_layers - 1))
    with pytest.raises(InputError, match=r"convolution, linear-attention or Mamba-2 layers \(LFM2, Qwen3.5, "
                                         r"Granite 4.0-H, Nemotron-H\) keep a state.*"
                                         r"build it with --backend ort"):
        check_trt_config(TrtBuildConfig(BuildConfig(Path("e"), Path("o")), attention="native"), states)


def test_kv_rows_must_be_binding_aligned() -> None:
    check_alignment(MODEL, 2048)
    with pytest.raises(InputError, match=r"--max-seq-len 1001 makes each KV slot 384384 bytes.*multiple of 128"):
        check_alignment(MODEL, 1001)


def test_tensorrt_versions() -> None:
    assert version_tuple("10.13.2.6") == (10, 13, 2)
    check_tensorrt("10.9.0", "plugin")
    check_tensorrt("10.15.1", "native")
    with pytest.raises(BackendUnavailableError, match=r"--attention plugin needs TensorRT >= 10.9.*has 10.7.0"):
        check_tensorrt("10.7.0", "plugin")
    with pytest.raises(BackendUnavailableError, match=r"--attention native needs TensorRT >= 10.15.*has 10.14.1"):
        check_tensorrt("10.14.1", "native")


def test_fp16_checkpoint_keeps_rotary_frequencies_fp32() -> None:
    ckpt = Checkpoint(MODEL, {"embed.weight": np.ones((4, 2), np.float32), INV_FREQ: np.ones(2, np.float32),
                              "ids": np.arange(3)})
    half = fp16_checkpoint(ckpt).weights
    assert half["embed.weight"].dtype == np.float16 and half[INV_FREQ].dtype == np.float32
    assert half["ids"].dtype == np.arange(3).dtype


def test_settings_record_profiles_versions_and_gpu() -> None:
    kv = io.kv_spec(MODEL, "float16", layout="inplace")
    limits = TrtLimits(max_batch_size=64, max_input_len=512, max_seq_len=2048)
    profiles = plan_profiles(limits, *io.inplace_specs(MODEL, kv, "onnx"))
    env = {"tensorrt": "10.13.0", "gpu": "NVIDIA H200", "compute_capability": "9.0"}
    cfg = TrtBuildConfig(BuildConfig(Path("e"), Path("o")), limits)
    settings = trt_settings(cfg, limits, profiles, env)
    assert settings.tensorrt == "10.13.0" and settings.compute_capability == "9.0"
    assert settings.gpu == "NVIDIA H200" and settings.attention == "plugin" and settings.precision == "fp16"
    assert settings.limits == {"max_batch_size": 64, "max_input_len": 512, "max_seq_len": 2048,
                                  "max_num_tokens": None}
    assert settings.profiles["prefill"]["input_ids"] == {"min": [1, 1], "opt": [32, 256], "max": [64, 512]}
    assert settings.profiles["decode"]["past_key_values.0.key"]["min"] == [1, 3, 2048, 64]
    assert TrtLimits(**settings.limits) == limits  # what TrtEngine reads back


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed here: this checks the message on machines without it")
def test_build_without_tensorrt_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError, match=r"TensorRT is not installed.*use --backend ort"):
        build_trt(BuildConfig(tmp_path / "export", tmp_path / "engine", backend="trt"))
