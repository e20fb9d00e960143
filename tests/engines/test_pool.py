"""llmc's own thread pool for its operators (llmc/engines/kernels/pool.c): every task of every call runs exactly
once, under concurrent callers and in a forked child; engines whose parallel nodes are all llmc's run on it, compute
the same bits as on ONNX Runtime's pool, and other graphs keep ONNX Runtime's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import Built
from onnx import TensorProto, helper

from llmc.engines.kernels import _library
from llmc.engines.ort.build import BuildConfig, build_ort
from llmc.engines.ort.run import uses_own_pool
from llmc.engines.registry import load_engine_dir
from llmc.errors import EngineError

PROMPT = [1, 5, 9, 13, 2, 7]


@pytest.mark.parametrize(("threads", "total"), [(2, 2), (2, 3), (2, 1000), (3, 17), (4, 16), (8, 5), (2, 1), (2, 0)])
def test_every_task_of_every_call_runs_exactly_once(threads: int, total: int) -> None:
    assert _library().llmc_ops_pool_check(threads, 3000, total) == 0


def test_a_larger_call_after_a_smaller_one_runs_each_task_once_and_returns() -> None:
    """Calls of 2 and 3 tasks in turn: a worker that read a finished call's word and then the next call's larger
    total claimed a task under the old generation, so it ran twice and the caller waited forever (pool.c). In a
    child process, so that a hang fails the test instead of stopping the run; 200,000 calls take well under a
    second, and before the fix hung within seconds on every try."""
    import subprocess
    import sys

    code = ("from llmc.engines.kernels import _library; "
            "print(_library().llmc_ops_pool_check_alternating(2, 200000, 2, 3))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the pool's caller never saw its call end (calls of 2 and 3 tasks in turn)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


def test_concurrent_callers_each_get_all_their_tasks_run() -> None:
    """One call at a time takes the pool; the others meanwhile run their tasks in their own threads."""
    results: list[int] = []

    def caller() -> None:
        results.append(_library().llmc_ops_pool_check(2, 3000, 7))  # ctypes lets go of the GIL: truly concurrent

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == [0, 0, 0, 0]


def test_a_forked_child_runs_its_calls_without_the_parents_workers() -> None:
    lib = _library()
    assert lib.llmc_ops_pool_check(2, 10, 4) == 0 and lib.llmc_ops_pool_workers() >= 1
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0 if lib.llmc_ops_pool_check(2, 200, 9) == 0 and lib.llmc_ops_pool_workers() >= 1 else 3)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's pool call never finished (it waited on the parent's workers)")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _graph(*ops: tuple[str, str]) -> onnx.ModelProto:
    nodes = [helper.make_node(op, ["x"], [f"y{i}"], domain=domain) for i, (domain, op) in enumerate(ops)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1]) for i in range(len(ops))])
    return helper.make_model(graph)


def test_the_pool_is_llmcs_only_where_every_parallel_node_is(monkeypatch: pytest.MonkeyPatch) -> None:
    llmc_only = _graph(("ai.llmc", "MatMulQ4"), ("ai.llmc", "CachedAttentionF16Cache"), ("", "Gather"), ("", "Cast"))
    assert uses_own_pool(llmc_only, 2)
    assert not uses_own_pool(llmc_only, 1)  # one thread: no pool at all
    for heavy in [("", "MatMul"), ("com.microsoft", "MatMulNBits"), ("com.microsoft", "GroupQueryAttention")]:
        assert not uses_own_pool(_graph(("ai.llmc", "MatMulQ4"), heavy), 2), heavy
    monkeypatch.setenv("LLMC_POOL", "onnxruntime")
    assert not uses_own_pool(llmc_only, 2)
    monkeypatch.setenv("LLMC_POOL", "threads")
    with pytest.raises(EngineError, match=r"^LLMC_POOL='threads': must be auto .* or onnxruntime$"):
        uses_own_pool(llmc_only, 2)


@pytest.fixture(scope="module")
def int4_engine(tiny_llama: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pool") / "int4"
    build_ort(BuildConfig(tiny_llama.export_dir, out, quant="int4", quality_target=0.0, allow_divergence=True,
                          threads=2))
    return out


def _logits(engine: object) -> np.ndarray:
    kv = engine.new_kv_cache(2, 32)  # type: ignore[attr-defined]
    first = engine.prefill([0, 1], [PROMPT, PROMPT[:3]], kv)  # type: ignore[attr-defined]
    return np.concatenate([first, engine.decode([0, 1], [[3], [4]], kv)])  # type: ignore[attr-defined]


def test_an_engine_of_llmcs_operators_runs_on_llmcs_pool_with_the_same_bits(int4_engine: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    own = load_engine_dir(int4_engine)
    options = own._decode.get_session_options()
    assert options.intra_op_num_threads == 1 and options.get_session_config_entry("llmc.pool") == "llmc"
    assert options.get_session_config_entry("llmc.threads") == "2"
    got = _logits(own)
    assert _library().llmc_ops_pool_workers() >= 1
    monkeypatch.setenv("LLMC_POOL", "onnxruntime")
    theirs = load_engine_dir(int4_engine)
    options = theirs._decode.get_session_options()
    assert options.intra_op_num_threads == 2 and options.get_session_config_entry("llmc.threads") == "2"
    np.testing.assert_array_equal(got, _logits(theirs))
