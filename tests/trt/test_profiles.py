"""Profile planning, limits validation and the shape check that quotes min/opt/max (CPU only)."""

from __future__ import annotations

import pytest

from llmc.engines.trt.profiles import Profile, TrtLimits, check_shapes, opt_size, plan_profiles
from llmc.errors import EngineError, InputError, LimitError
from llmc.graph import io_names as io
from llmc.manifest import ModelSpec

MODEL = ModelSpec(family="llama", hf_architecture="LlamaForCausalLM", hidden_size=576, num_layers=2, num_heads=9,
                  num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152, max_positions=8192,
                  norm="rms", norm_eps=1e-5, activation="silu", positions="rope")


def _specs():
    kv = io.kv_spec(MODEL, "float16", layout="inplace")
    return io.inplace_specs(MODEL, kv, "onnx")


def test_opt_is_tensorrt_llm_middle() -> None:
    assert [opt_size(m) for m in (1, 2, 7, 8, 64, 2048)] == [1, 1, 4, 4, 32, 1024]


@pytest.mark.parametrize("kwargs, match", [
    ({"max_batch_size": 0}, r"--max-batch-size must be >= 1, got 0"),
    ({"max_input_len": -3}, r"--max-input-len must be >= 1, got -3"),
    ({"max_num_tokens": 0}, r"--max-num-tokens must be >= 1, got 0"),
    ({"max_input_len": 4096, "max_seq_len": 2048}, r"--max-input-len 4096 exceeds --max-seq-len 2048"),
    ({"max_num_tokens": 3000, "max_seq_len": 2048}, r"--max-num-tokens 3000 exceeds --max-seq-len 2048"),
])
def test_limits_name_value_and_limit(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(InputError, match=match):
        TrtLimits(**kwargs)


def test_limits_against_the_model() -> None:
    TrtLimits(max_seq_len=8192).check_model(MODEL.max_positions)
    with pytest.raises(LimitError, match=r"--max-seq-len 16384 exceeds the model's 8192 positions"):
        TrtLimits(max_seq_len=16384).check_model(MODEL.max_positions)


def test_plan_for_the_inplace_graphs() -> None:
    limits = TrtLimits(max_batch_size=64, max_input_len=512, max_seq_len=2048, max_num_tokens=None)
    plans = plan_profiles(limits, *_specs())
    prefill, decode = plans["prefill"].inputs, plans["decode"].inputs
    assert set(prefill) == {"input_ids", "position_ids"} | {f"past_key_values.{i}.{k}" for i in range(2)
                                                            for k in ("key", "value")}
    ids = prefill["input_ids"]
    assert (ids.min, ids.opt, ids.max) == ((1, 1), (32, 256), (64, 512))
    assert decode["input_ids"].max == (64, 1) and decode["input_ids"].opt == (32, 1)  # one token per step
    past = decode["past_key_values.1.value"]
    assert (past.min, past.opt, past.max) == ((1, 3, 2048, 64), (32, 3, 2048, 64), (64, 3, 2048, 64))
    chunked = plan_profiles(TrtLimits(max_batch_size=8, max_num_tokens=128), *_specs())["decode"]
    assert chunked.inputs["position_ids"].max == (8, 128) and chunked.inputs["position_ids"].opt == (4, 64)


def test_profiles_round_trip_through_the_manifest() -> None:
    prefill_spec, decode_spec = _specs()
    plan = plan_profiles(TrtLimits(), prefill_spec, decode_spec)["decode"]
    back = Profile.from_json("decode", decode_spec, plan.to_json())
    assert back == plan


def test_planning_refuses_concat_graphs() -> None:
    kv = io.kv_spec(MODEL, "float16")
    with pytest.raises(InputError, match="in-place graphs only"):
        plan_profiles(TrtLimits(), io.prefill_spec(MODEL, kv), io.decode_spec(MODEL, kv))


def _shapes(batch: int, seq: int, max_seq: int = 2048) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"input_ids": (batch, seq), "position_ids": (batch, seq)}
    shapes.update({f"past_key_values.{i}.{k}": (batch, 3, max_seq, 64) for i in range(2) for k in ("key", "value")})
    return shapes


def test_check_shapes_quotes_min_opt_max() -> None:
    plans = plan_profiles(TrtLimits(max_batch_size=8, max_input_len=512, max_seq_len=2048), *_specs())
    check_shapes(plans["prefill"], _shapes(8, 512))
    check_shapes(plans["decode"], _shapes(1, 1))
    with pytest.raises(LimitError, match=r"prefill input input_ids dimension 1 \(sequence\) is 600, outside the "
                                         r"engine's optimization profile min 1 / opt 256 / max 512; rebuild with a "
                                         r"larger --max-input-len"):
        check_shapes(plans["prefill"], _shapes(2, 600))
    with pytest.raises(LimitError, match=r"decode input input_ids dimension 0 \(batch\) is 9.*min 1 / opt 4 / max 8"
                                         r".*--max-batch-size"):
        check_shapes(plans["decode"], _shapes(9, 1))
    with pytest.raises(LimitError, match=r"dimension 1 \(sequence\) is 2.*max 1.*--max-num-tokens"):
        check_shapes(plans["decode"], _shapes(1, 2))
    with pytest.raises(LimitError, match=r"past_key_values.0.key dimension 2 \(max_sequence\) is 1024.*"
                                         r"min 2048 / opt 2048 / max 2048"):
        check_shapes(plans["decode"], _shapes(1, 1, max_seq=1024))


def test_check_shapes_names_missing_and_unexpected_inputs() -> None:
    plan = plan_profiles(TrtLimits(), *_specs())["decode"]
    shapes = _shapes(1, 1)
    del shapes["position_ids"]
    shapes["attention_mask"] = (1, 1)
    with pytest.raises(EngineError, match=r"missing \['position_ids'\], unexpected \['attention_mask'\]"):
        check_shapes(plan, shapes)
