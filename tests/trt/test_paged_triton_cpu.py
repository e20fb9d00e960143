"""The paged attention (block tables) without a GPU: its numpy reference against the slot reference on the same data
laid out in slots, the Triton kernel in Triton's interpreter against that reference (paged_interpret_check.py), its
ahead-of-time compile to PTX, and the TensorRT plugin's registration against a stand-in `tensorrt.plugin`."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

# triton (dev extra) and torch (export extra) are test dependencies: no skip, a missing one is a failure.
import torch  # noqa: F401
import triton  # noqa: F401

from llmc.engines.trt.plugin import attention_reference, paged_attention_reference

from .interpreter_run import run_interpreter

SCRIPT = Path(__file__).with_name("paged_interpret_check.py")
BS = 4  # block size of the reference checks


def slot_and_paged(starts: list[int], counts: list[int], seq: int, max_blocks: int, shared: int = 0,
                   heads: int = 4, kv_heads: int = 2, dim: int = 8) -> dict[str, np.ndarray]:
    """Random slot caches [B, Hkv, max_blocks * BS, D] and the same data in pools through shuffled block tables
    (each row all its max_blocks, the first `shared` of row 1 being row 0's, whose slot data is made equal), plus
    two spare pool blocks; right-padded rows (pads at position 0)."""
    rng = np.random.default_rng(3)
    batch = len(starts)
    q = rng.standard_normal((batch, heads, seq, dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((batch, kv_heads, seq, dim)).astype(np.float32) for _ in range(2))
    slot_k, slot_v = (rng.standard_normal((batch, kv_heads, max_blocks * BS, dim)).astype(np.float32)
                      for _ in range(2))
    num_blocks = batch * max_blocks - shared + 2
    free = list(rng.permutation(num_blocks))
    table = np.zeros((batch, max_blocks), np.int32)
    pool_k, pool_v = (rng.standard_normal((num_blocks, kv_heads, BS, dim)).astype(np.float32) for _ in range(2))
    for b in range(batch):
        for i in range(max_blocks):
            at = slice(i * BS, (i + 1) * BS)
            if b == 1 and i < shared:
                table[b, i] = table[0, i]
                slot_k[b, :, at], slot_v[b, :, at] = slot_k[0, :, at], slot_v[0, :, at]
            else:
                table[b, i] = free.pop()
                pool_k[table[b, i]], pool_v[table[b, i]] = slot_k[b, :, at], slot_v[b, :, at]
    pos = np.zeros((batch, seq), np.int64)
    for b in range(batch):
        pos[b, : counts[b]] = starts[b] + np.arange(counts[b])
    return dict(q=q, k_new=k_new, v_new=v_new, slot_k=slot_k, slot_v=slot_v, pool_k=pool_k, pool_v=pool_v,
                table=table, pos=pos)


@pytest.mark.parametrize(("starts", "counts", "seq", "shared", "window", "softcap"), [
    ([0, 0, 0], [5, 2, 3], 5, 0, 0, 0.0),  # prefill, right-padded rows
    ([6, 9], [3, 1], 3, 0, 0, 0.0),  # chunks after cached blocks, non-aligned starts, one crossing a block
    ([4, 13, 0], [1, 1, 1], 1, 0, 0, 0.0),  # decode, rows of different lengths
    ([9, 5], [2, 2], 2, 1, 3, 0.7),  # a shared prefix block, window and softcap
])
def test_paged_reference_matches_the_slot_reference(starts: list[int], counts: list[int], seq: int, shared: int,
                                                    window: int, softcap: float) -> None:
    d = slot_and_paged(starts, counts, seq, max_blocks=5, shared=shared)
    args = d["q"], d["k_new"], d["v_new"]
    out, pk, pv = paged_attention_reference(*args, d["pool_k"], d["pool_v"], d["table"], d["pos"], 0.4,
                                            window=window, softcap=softcap)
    want, wk, wv = attention_reference(*args, d["slot_k"], d["slot_v"], d["pos"], 0.4, window=window,
                                       softcap=softcap)
    for b, n in enumerate(counts):
        assert np.abs(out[b, :, :n] - want[b, :, :n]).max() < 1e-6  # real queries; pads are garbage by contract
        length = starts[b] + n  # the row's cache through its real tokens, read back through its table
        got_k = pk[d["table"][b]].transpose(1, 0, 2, 3).reshape(wk.shape[1], -1, wk.shape[3])
        got_v = pv[d["table"][b]].transpose(1, 0, 2, 3).reshape(wv.shape[1], -1, wv.shape[3])
        assert np.array_equal(got_k[:, :length], wk[b, :, :length])
        assert np.array_equal(got_v[:, :length], wv[b, :, :length])


def test_paged_reference_writes_only_the_new_tokens() -> None:
    """Everything but the rows' real new tokens stays as it was: pad positions, later positions of the written
    blocks, other blocks, the spare ones; the inputs are not modified (updated copies come back)."""
    d = slot_and_paged([6, 9], [3, 1], 3, max_blocks=4)
    before_k, before_v = d["pool_k"].copy(), d["pool_v"].copy()
    _, pk, pv = paged_attention_reference(d["q"], d["k_new"], d["v_new"], d["pool_k"], d["pool_v"], d["table"],
                                          d["pos"], 0.4)
    assert np.array_equal(d["pool_k"], before_k) and np.array_equal(d["pool_v"], before_v)
    written = np.zeros(pk.shape[:1] + pk.shape[2:3], bool)  # [num_blocks, BS]
    for b, (start, n) in enumerate([(6, 3), (9, 1)]):
        for j, t in enumerate(range(start, start + n)):
            block, off = d["table"][b, t // BS], t % BS
            written[block, off] = True
            assert np.array_equal(pk[block, :, off], d["k_new"][b, :, j])
            assert np.array_equal(pv[block, :, off], d["v_new"][b, :, j])
    untouched = ~written[:, None, :, None].repeat(pk.shape[1], 1).repeat(pk.shape[3], 3)
    assert written.sum() == 4
    assert np.array_equal(pk[untouched], before_k[untouched]) and np.array_equal(pv[untouched], before_v[untouched])


def test_paged_kernel_matches_reference_in_the_interpreter() -> None:
    results = run_interpreter(SCRIPT)
    assert len(results) == 2 * 7  # fp32 and fp16: the 7 cases of CASES
    for r in results:
        bound = 1e-5 if r["dtype"] == "float32" else 1e-2 * r["scale"]
        assert r["out_err"] <= bound, r  # NaN (a poisoned block was read) fails this too
        assert r["pool_err"] == 0.0, r  # new K/V copied bit for bit, nothing else written
    assert {r["case"]: r["skipped"] for r in results}["decode-window"] == 64  # 4 blocks before the window


def test_paged_kernel_compiles_ahead_of_time() -> None:
    from triton.backends.compiler import GPUTarget

    from llmc.engines.trt.plugin import PAGED_SIGNATURE, compile_paged_attention

    compiled = compile_paged_attention("float16", 8, 4, 128, 0.088, 16, 16, target=GPUTarget("cuda", 90, 32),
                                       window=4096, softcap=50.0)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx and f".entry {compiled.metadata.name}(" in ptx
    assert ptx.split(f".entry {compiled.metadata.name}(")[1].split(")")[0].count(".param") >= len(PAGED_SIGNATURE)
    with pytest.raises(ValueError, match="power of 2"):
        compile_paged_attention("float16", 8, 4, 128, 0.088, 16, 12, target=GPUTarget("cuda", 90, 32))


def _stand_in_plugin_module() -> tuple[ModuleType, dict[tuple[str, str], Any]]:
    """`tensorrt.plugin` reduced to what register_trt_plugin calls: the decorators record the functions."""
    registered: dict[tuple[str, str], Any] = {}
    trtp = ModuleType("tensorrt.plugin")

    def decorator(kind: str) -> Any:
        return lambda plugin_id: lambda fn: registered.setdefault((kind, plugin_id), fn)

    trtp.register, trtp.autotune, trtp.aot_impl = (decorator(k) for k in ("register", "autotune", "aot_impl"))
    trtp.TensorDesc = trtp.SymExprs = object
    trtp.AutoTuneCombination = lambda formats, layout: (formats, layout)
    trtp.KernelLaunchParams = SimpleNamespace
    trtp.cdiv = lambda a, b: -(-a // b)
    trtp.SymInt32 = int
    trtp.SymIntExprs = SimpleNamespace(from_tuple=tuple)
    return trtp, registered


def test_trt_plugin_registers_the_paged_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both plugin ids registered; the paged aot_impl compiles the paged kernel with the node's attributes and
    launches it on the slot plugin's grid with (S, max_blocks) as its two integer arguments."""
    import inspect

    import llmc.engines.trt.plugin as plugin
    from llmc.engines.trt.lower import PAGED_PLUGIN_ID, PLUGIN_ID

    trtp, registered = _stand_in_plugin_module()
    trt = ModuleType("tensorrt")
    trt.float16 = "float16"  # type: ignore[attr-defined]
    trt.plugin = trtp  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(plugin, "_TRT_REGISTERED", False)
    calls: list[tuple[Any, ...]] = []
    name = "llmc_paged_attention_fwd"  # a PTX entry of our 12 parameters and Triton's 2 scratch pointers
    ptx = (f".version 9.0\n.entry {name}(\n" + ",\n".join(f"\t.param .u64 {name}_param_{i}" for i in range(14))
           + f"\n)\n{{\n\tld.param.b64 %rd1, [{name}_param_11];\n}}\n")
    compiled = SimpleNamespace(metadata=SimpleNamespace(name=name, num_warps=4, shared=9216), asm={"ptx": ptx})
    monkeypatch.setattr(plugin, "compile_paged_attention", lambda *a, **k: calls.append((a, k)) or compiled)
    plugin.register_trt_plugin()
    assert {pid for _, pid in registered} == {PLUGIN_ID, PAGED_PLUGIN_ID}
    describe, aot = registered["register", PAGED_PLUGIN_ID], registered["aot_impl", PAGED_PLUGIN_ID]
    params = list(inspect.signature(describe).parameters)
    assert params[7:] == list(inspect.signature(registered["register", PLUGIN_ID]).parameters)[6:] + ["block_size"]
    assert list(inspect.signature(aot).parameters) == params + ["outputs", "tactic"]
    [(formats, _)] = registered["autotune", PAGED_PLUGIN_ID](*[None] * 8)
    assert formats.split(", ") == ["FP16"] * 5 + ["INT32", "INT64"] + ["FP16"] * 3  # 7 inputs, 3 outputs

    desc = SimpleNamespace(dtype="float16", like=lambda: "like", aliased=lambda: "aliased")
    q = SimpleNamespace(**vars(desc), shape_expr=(3, 8, 5, 128))  # B 3, H 8, S 5
    table = SimpleNamespace(**vars(desc), shape_expr=(3, 7))
    assert describe(q, *[desc] * 4, table, desc, 8, 4, 128, 0.088, 16, 0, 0.0, 16) == ("like", "aliased", "aliased")
    name, ptx, launch, extra = aot(q, *[desc] * 4, table, desc, 8, 4, 128, 0.088, 16, 64, 1.5, 16, (), 0)
    assert calls == [(("float16", 8, 4, 128, 0.088, 16, 16), {"window": 64, "softcap": 1.5})]
    assert (name, extra) == ("llmc_paged_attention_fwd", (5, 7))
    assert ptx.count(".param .u64") == 12 and ptx.endswith(f"{name}_param_11\n)\n{{\n\tld.param.b64 %rd1, [{name}_param_11];\n}}\n")
    assert (launch.grid_x, launch.grid_y, launch.block_x, launch.shared_mem) == (1, 12, 128, 9216)  # 5*2/16, 3*4
