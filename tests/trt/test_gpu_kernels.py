"""The Triton attention kernels on a GPU against torch's scaled_dot_product_attention, fp16 (prefill and decode,
grouped heads, several lengths): relative error <= 1e-2, launched by Triton and as TensorRT launches the plugins'
AOT kernels (aot_launch.py). Timings are printed (and tabled by scripts/gpu_check.sh)."""

from __future__ import annotations

import importlib.util

import pytest

from .aot_launch import CASES as AOT_CASES
from .aot_launch import Driver, answer, check
from .kernel_bench import CASES, compare, compare_paged


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU with CUDA torch and triton (none here)")]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-b{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-t{c[5]}" for c in CASES])
def test_triton_kernel_matches_sdpa(case: tuple) -> None:
    result = compare(*case)
    print(result)
    assert result["rel_err"] <= 1e-2, result


@pytest.mark.parametrize("case", CASES[1::2], ids=[f"{c[0]}-b{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-t{c[5]}" for c in CASES[1::2]])
def test_paged_kernel_matches_the_slot_kernel(case: tuple) -> None:
    result = compare_paged(*case)
    print(result)
    assert result["rel_err"] <= 1e-3 and result["kv_equal"], result


@pytest.mark.parametrize("case", AOT_CASES, ids=[f"{'paged' if c[6] else 'slot'}-{c[0]}-b{c[1]}-d{c[4]}-t{c[5]}"
                                                 for c in AOT_CASES])
def test_aot_kernel_launched_as_tensorrt_launches_it(case: tuple) -> None:
    """The plugin's AOT answer (PTX, grid, block, shared memory, extra args) through the CUDA driver in TensorRT's
    argument order, the caches aliased: the attention matches SDPA and the cache holds the new K/V exactly."""
    driver = Driver()
    ok, detail = check(answer(*case), driver)
    print(detail)
    assert ok, detail
