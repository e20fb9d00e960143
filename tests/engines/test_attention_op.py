"""llmc's attention operator (ai.llmc.CachedAttention) against a float64 numpy reference, through ONNX Runtime.

One-node graphs run the compiled library as an engine does: in place (IOBinding, present bound to the past's memory)
and through plain `run` (ONNX Runtime allocates the present: the past is copied into it first); both the AVX-512
and the portable path (LLMC_KERNELS_GENERIC=1), fp32, fp16 and int8 caches, prompts (right-padded, causal), one-token
decode rows long enough to be split across the pool's threads, prompt chunks after a past, no rotary, partial rotary,
a local window and a softcap; the window, softcap and partial rotary also against ONNX Runtime's GroupQueryAttention.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import Built
from onnx import TensorProto, helper

from llmc.engines.kernels import ops_version
from llmc.engines.trt.plugin import attention_reference


@pytest.fixture(scope="module")
def library(llmc_ops: Path) -> Path:
    return llmc_ops


CACHES = {"fp32": (TensorProto.FLOAT, "CachedAttention"), "fp16": (TensorProto.FLOAT16, "CachedAttentionF16Cache"),
          "int8": (TensorProto.INT8, "CachedAttentionI8Cache")}


def _graph(path: Path, H: int, Hkv: int, cache: str, rope: bool, op: str = "", new_tokens: bool = False,
           sinks: bool = False, **attrs: Any) -> Path:
    """A one-node graph of the cache's op (or `op`: com.microsoft.GroupQueryAttention), extra attributes `attrs`;
    `new_tokens`: the op's 9th input (each row's count of new tokens) is fed; `sinks`: its 10th (GroupQueryAttention's
    12th, head_sink)."""
    kv_type, llmc_op = CACHES[cache]
    gqa = op == "GroupQueryAttention"
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["B", "S", "W"]),
              helper.make_tensor_value_info("past_key", kv_type, ["B", Hkv, "L", "D"]),
              helper.make_tensor_value_info("past_value", kv_type, ["B", Hkv, "L", "D"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    if rope:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["P", "R"]) for n in ("cos", "sin")]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", "HD"]),
               helper.make_tensor_value_info("present_key", kv_type, ["B", Hkv, "L", "D"]),
               helper.make_tensor_value_info("present_value", kv_type, ["B", Hkv, "L", "D"])]
    names = [i.name for i in inputs]
    if new_tokens:
        inputs.append(helper.make_tensor_value_info("new_tokens", TensorProto.INT32, ["B"]))
        names += [""] * (8 - len(names)) + ["new_tokens"]  # no block table (input 7): the slot layout
    if gqa:  # query packed with key and value: its key and value inputs are left out; the rotary is its own
        names, attrs = [*names[:1], "", "", *names[1:]], {**attrs, "do_rotary": int(rope)}
    if sinks:
        inputs.append(helper.make_tensor_value_info("sinks", TensorProto.FLOAT, ["heads"]))
        names += [""] * ((11 if gqa else 9) - len(names)) + ["sinks"]
    domain = "com.microsoft" if gqa else "ai.llmc"
    node = helper.make_node(op or llmc_op, names, [o.name for o in outputs], domain=domain, num_heads=H,
                            kv_num_heads=Hkv, scale=0.3, **attrs)
    model = helper.make_model(helper.make_graph([node], "attn", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def _session(library: Path, graph: Path, threads: int = 2) -> object:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])


def _rotate(x: np.ndarray, pos: np.ndarray, cos: np.ndarray | None, sin: np.ndarray | None) -> np.ndarray:
    """Rotate-half RoPE of x [..., n, D] at positions pos [n] (GroupQueryAttention's non-interleaved form) over the
    first 2R dims, R = the tables' width (R < D/2: partial rotary, the other dims unchanged)."""
    if cos is None or sin is None:
        return x
    r = cos.shape[-1]
    c, s, x1, x2 = cos[pos], sin[pos], x[..., :r], x[..., r:2 * r]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * r:]], -1)


def _reference(qkv: np.ndarray, k: np.ndarray, v: np.ndarray, past: list[int], new: list[int], H: int, Hkv: int,
               cos: np.ndarray | None, sin: np.ndarray | None, window: int = 0,
               softcap: float = 0.0, sinks: np.ndarray | None = None, chunk: int = 0) -> tuple[np.ndarray, ...]:
    """Each row's valid tokens, rotated here, through the project's attention reference (the TensorRT plugin's:
    writes at positions, causal over the written cache); padded query rows give zeros and write nothing."""
    B, S, _ = qkv.shape
    D = k.shape[-1]
    out, k, v = np.zeros((B, S, H * D)), k.astype(np.float64), v.astype(np.float64)
    for b in range(B):
        n, pos = new[b], past[b] + np.arange(new[b])
        heads = qkv[b, :n].astype(np.float64).reshape(n, H + 2 * Hkv, D).transpose(1, 0, 2)  # [heads, n, D]
        q, k_new = _rotate(heads[:H], pos, cos, sin), _rotate(heads[H:H + Hkv], pos, cos, sin)
        attn, k[b:b + 1], v[b:b + 1] = attention_reference(q[None], k_new[None], heads[None, H + Hkv:], k[b:b + 1],
                                                           v[b:b + 1], pos[None], 0.3, window, softcap, sinks,
                                                           chunk)
        out[b, :n] = attn[0].transpose(1, 0, 2).reshape(n, H * D)
    return out, k, v


CASES: dict[str, tuple[Any, ...]] = {  # name: (B, S, H, Hkv, D, L, past per row, new per row, first prompt[, opts])
    "prompt-right-padded": (2, 7, 6, 2, 32, 16, [0, 0], [7, 3], True),
    "decode-split-rows": (3, 1, 6, 2, 64, 1100, [1099, 5, 600], [1, 1, 1], False),
    "chunk-after-past": (1, 5, 4, 1, 16, 40, [17], [5], False),
    "odd-head-size": (2, 3, 3, 3, 10, 12, [2, 4], [3, 3], False),
    # opts: window (GroupQueryAttention's local_window_size: each query sees its last W positions), softcap, and
    # rotary: the tables' width R < D/2 (partial rotary: the first 2R dims rotated). The 300-key window is split in
    # two: rows 1099 and 600 read keys from 800 and 301 on, row 5 all its 6.
    "prompt-window-partial-rotary": (2, 7, 6, 2, 32, 16, [0, 0], [7, 3], True, {"window": 3, "rotary": 8}),
    "decode-window-split-rows-softcap": (3, 1, 6, 2, 64, 1100, [1099, 5, 600], [1, 1, 1], False,
                                         {"window": 300, "softcap": 2.0, "rotary": 16}),
    "chunk-after-past-window-softcap": (1, 5, 4, 1, 16, 40, [17], [5], False,
                                        {"window": 6, "softcap": 2.0, "rotary": 3}),
    # attention_chunk (Llama 4): each query sees its own block of C positions: rows 1099 and 600 from 1024 and 512,
    # split over the block; a prompt's blocks of query positions across the blocks of keys (and 77 valid of 140)
    "decode-attention-chunks-split-rows": (3, 1, 6, 2, 64, 1100, [1099, 5, 600], [1, 1, 1], False,
                                           {"attention_chunk": 256, "rotary": 16}),
    "prompt-d64-blocks-attention-chunks": (2, 140, 6, 2, 64, 160, [0, 0], [140, 77], True, {"attention_chunk": 48}),
    # head size 64 (the AVX-512 path's own loop, 16 keys reduced at a time), prompts across several groups of 16 keys
    "prompt-d64": (2, 19, 8, 2, 64, 24, [0, 0], [19, 7], True),
    # new_tokens: rows after a past with different counts in one run (right-padded), 4 and 10 query heads per KV
    # head (10: past the 8 the reduced loop holds), a row without a past among them
    "chunks-mixed-counts-d64": (2, 6, 8, 2, 64, 64, [37, 3], [6, 2], False, {"new_tokens": True}),
    "chunks-mixed-counts-many-heads": (3, 4, 20, 2, 64, 48, [20, 0, 9], [4, 1, 3], False,
                                       {"new_tokens": True, "window": 12}),
    # head size 64 with 6 query heads a KV head (the most whose 24 value accumulators stay in registers) and 8 (one
    # column block at a time), over more than one chunk of 128 keys
    "decode-d64-6-heads": (2, 1, 12, 2, 64, 200, [150, 7], [1, 1], False),
    "decode-d64-8-heads": (1, 1, 8, 1, 64, 200, [170], [1], False),
    # head size 128 with 1 and 2 query heads a KV head (all value accumulators in registers, one pass a chunk)
    "decode-d128-2-heads": (2, 1, 4, 2, 128, 300, [280, 9], [1, 1], False),
    "decode-d128-1-head": (1, 1, 2, 2, 128, 300, [290], [1], False),
    # prompts in blocks of positions scored together (5 positions x 3 query heads a unit here), each masked to its
    # own keys: across chunks of 128 keys, the last block partial; and a window + softcap whose blocks start inside
    # a chunk, with a shorter second row
    "prompt-d64-blocks-long": (1, 150, 9, 3, 64, 160, [0], [150], True),
    "prompt-d64-blocks-window-softcap": (2, 140, 6, 2, 64, 160, [0, 0], [140, 77], True,
                                         {"window": 50, "softcap": 2.0}),
    # 32 positions or more on AMX tiles where the CPU has them: chunks after a past (keys packed from 0, blocks
    # starting off a multiple of 32), right-padded rows of different counts, a head size of 32
    "chunk-after-past-d64-tiles": (1, 40, 9, 3, 64, 200, [101], [40], False),
    "chunks-mixed-counts-d64-tiles": (2, 36, 6, 2, 64, 120, [50, 0], [36, 20], False, {"new_tokens": True}),
    "prompt-d32-tiles": (2, 33, 4, 2, 32, 40, [0, 0], [33, 5], True),
    # head sizes 128 and 256: the value tiles in passes of 4 column tiles (64 dims)
    "prompt-d128-tiles": (1, 34, 4, 2, 128, 40, [0], [34], True),
    "prompt-d256-tiles": (1, 33, 2, 2, 256, 40, [0], [33], True),
    # head size 80: an int8 row's last group holds 16 values, past the Hadamard matrix's whole 32s (its keys' first
    # 64 dims go through it, the last 16 as they are); 32 positions or more: the packed keys take its query vectors
    # as columns
    "prompt-d80-partial-group": (1, 36, 4, 2, 80, 40, [0], [36], True),
    "decode-d80-partial-group": (2, 1, 4, 2, 80, 300, [280, 9], [1, 1], False),
    # latent attention's shapes (DeepSeek's: every query head on one KV head of the latent and the rotated key):
    # more query heads than a unit holds (64, or 8192 floats of query rows), split over units that each read the
    # head's keys; a decode over a split row and a prompt whose units score one position
    "decode-mla-80-heads": (2, 1, 80, 1, 64, 300, [280, 9], [1, 1], False, {"rotary": 8}),
    "decode-mla-d576-split": (1, 1, 18, 1, 576, 1100, [1099], [1], False, {"rotary": 32}),
    "prompt-mla-d576": (2, 9, 18, 1, 576, 24, [0, 0], [9, 4], True, {"rotary": 32}),
    # sinks (GPT-OSS: one more logit a head's softmax takes, whose value is 0): decode rows split across the threads
    # (the partial sums merged), a prompt's blocks under a window, rows of different counts on the tiles' path
    "decode-split-rows-sinks": (3, 1, 6, 2, 64, 1100, [1099, 5, 600], [1, 1, 1], False, {"sinks": True}),
    "prompt-d64-blocks-window-sinks": (2, 140, 6, 2, 64, 160, [0, 0], [140, 77], True, {"window": 50, "sinks": True}),
    "chunks-mixed-counts-d64-tiles-sinks": (2, 36, 6, 2, 64, 120, [50, 0], [36, 20], False,
                                            {"new_tokens": True, "sinks": True}),
}


PROMPT_PATH_CASES = ["prompt-d64-blocks-long", "prompt-d64-blocks-window-softcap", "chunk-after-past-d64-tiles",
                     "chunks-mixed-counts-d64-tiles", "prompt-d32-tiles", "prompt-d128-tiles", "prompt-d256-tiles"]


def _options(case: tuple) -> dict[str, Any]:
    return case[9] if len(case) > 9 else {}


def _attrs(case: tuple) -> dict[str, Any]:
    """The case's node attributes (GroupQueryAttention's names; none given: the defaults, no window and no cap)."""
    opts = _options(case)
    return {a: opts[o] for a, o in (("local_window_size", "window"), ("softcap", "softcap"),
                                    ("attention_chunk_size", "attention_chunk")) if o in opts}


GROUP = 32  # int8 cache: values per fp16 scale


def _quantize_rows(x: np.ndarray) -> np.ndarray:
    """[..., D] float -> the int8 cache's rows [..., D + 2 ceil(D / 32)]: D int8, then an fp16 scale per 32."""
    groups = [x[..., i:i + GROUP] for i in range(0, x.shape[-1], GROUP)]
    scales = np.stack([np.abs(g).max(axis=-1) / 127 for g in groups], axis=-1).astype(np.float16)
    inv = np.where(scales > 0, 1 / np.where(scales > 0, scales, 1).astype(np.float32), 0)
    q = np.concatenate([np.clip(np.rint(g * inv[..., i:i + 1]), -127, 127) for i, g in enumerate(groups)], -1)
    return np.concatenate([q.astype(np.int8), scales.view(np.int8)], axis=-1)


def _hadamard(n: int) -> np.ndarray:
    """The n-point Hadamard matrix scaled to be orthonormal (symmetric: its own inverse)."""
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def _cache_values(buf: np.ndarray, keys: bool = False) -> np.ndarray:
    """A cache buffer's values in float64 (int8 rows: each group's q times its scale; an int8 cache's keys are stored
    times the 32-point Hadamard matrix on each whole 32 of their dims, which this undoes)."""
    if buf.dtype != np.int8:
        return buf.astype(np.float64)
    n = buf.shape[-1]
    d = next(d for d in range(n, 0, -1) if d + 2 * -(-d // GROUP) == n)
    scales = np.ascontiguousarray(buf[..., d:]).view(np.float16).astype(np.float64)
    x = buf[..., :d].astype(np.float64) * np.repeat(scales, GROUP, axis=-1)[..., :d]
    if keys:
        for d0 in range(0, d - 31, 32):
            x[..., d0:d0 + 32] = x[..., d0:d0 + 32] @ _hadamard(32)
    return x


def _inputs(case: tuple, cache: str, rope: bool, seed: int = 0,
            rotary: int = 0) -> tuple[dict[str, np.ndarray], tuple]:
    """Feeds and the reference's (out, present_key, present_value); `rotary`: the tables' width, else the case's,
    else D/2."""
    B, S, H, Hkv, D, L, past, new, first = case[:9]
    opts = _options(case)
    R = rotary or opts.get("rotary", D // 2)
    rng = np.random.default_rng(seed)
    def past_cache() -> np.ndarray:
        x = rng.standard_normal((B, Hkv, L, D))
        return _quantize_rows(x.astype(np.float32)) if cache == "int8" else x.astype(
            np.float16 if cache == "fp16" else np.float32)

    feeds = {"qkv": rng.standard_normal((B, S, (H + 2 * Hkv) * D)).astype(np.float32),
             "past_key": past_cache(), "past_value": past_cache(),
             "seqlens_k": np.array([p + n - 1 for p, n in zip(past, new)], np.int32),
             "total_sequence_length": np.array(S if first else max(p + n for p, n in zip(past, new)), np.int32)}
    if opts.get("new_tokens"):
        feeds["new_tokens"] = np.array(new, np.int32)
    if opts.get("sinks"):  # around the scores' own size, so that neither term of the sum is negligible
        feeds["sinks"] = (rng.standard_normal(H) * 2).astype(np.float32)
    if rope:
        freqs = np.outer(np.arange(L + 3), 1.0 / 10000 ** (np.arange(0, 2 * R, 2) / (2 * R)))
        feeds["cos"], feeds["sin"] = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
    expected = _reference(feeds["qkv"], _cache_values(feeds["past_key"], keys=True),
                          _cache_values(feeds["past_value"]), past, new, H, Hkv, feeds.get("cos"), feeds.get("sin"),
                          opts.get("window", 0), opts.get("softcap", 0.0), feeds.get("sinks"),
                          opts.get("attention_chunk", 0))
    return feeds, expected


def _run_in_place(library: Path, tmp_path: Path, case: tuple, cache: str, rope: bool,
                  feeds: dict[str, np.ndarray], **attrs: Any) -> np.ndarray:
    """The case's output; its past caches (in `feeds`) updated in place as the engines bind them; `attrs`: more
    node attributes."""
    import onnxruntime as ort

    session = _session(library, _graph(tmp_path / "a.onnx", case[2], case[3], cache, rope,
                                       new_tokens=bool(_options(case).get("new_tokens")),
                                       sinks=bool(_options(case).get("sinks")), **_attrs(case), **attrs))
    binding = session.io_binding()  # type: ignore[attr-defined]
    binding.bind_output("out")  # first: copy_outputs_to_cpu lists the outputs in the order they were bound
    for name_in, array in feeds.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(name_in, value)
        if name_in.startswith("past_"):
            binding.bind_ortvalue_output(name_in.replace("past_", "present_"), value)
    session.run_with_iobinding(binding)  # type: ignore[attr-defined]
    return binding.copy_outputs_to_cpu()[0]


@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_in_place(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                    cache: str, generic: bool) -> None:
    monkeypatch.setenv("LLMC_KERNELS_GENERIC", "1" if generic else "0")
    case = CASES[name]
    rope = name != "odd-head-size"
    feeds, (out, k, v) = _inputs(case, cache, rope)
    got = _run_in_place(library, tmp_path, case, cache, rope, feeds)
    # an fp16 cache rounds the new K and V to 11 bits, an int8 one to half a step of max |row| / 127 (the 33-row
    # prompt of head size 32: its worst element 3.6e-2 off)
    tol = {"fp32": 2e-5, "fp16": 3e-3, "int8": 4e-2}[cache]
    if cache == "int8" and (_options(case).get("window") or case[4] >= 64):
        # a few keys' weighted mean averages less rounding away; 64-dim scores make a sharper softmax (the worst
        # element 5.4e-2 off, in the 36-row chunks of mixed counts; the portable path's and the blocks' alike), 128
        # and 256 sharper still (6.8e-2, the portable path's and the tiles' alike)
        tol = 6e-2 if case[4] <= 64 else 8e-2
    if case[4] > 256 and cache != "fp32":  # (576-dim rows, latent attention's: 6.8e-3 fp16, 9.6e-2 int8 worst)
        tol = {"fp16": 1e-2, "int8": 1.2e-1}[cache]
    np.testing.assert_allclose(got, out, atol=tol, rtol=0)
    # the cache was updated where it lives: the new K/V at their positions, every other position untouched
    np.testing.assert_allclose(_cache_values(feeds["past_key"], keys=True), k, atol=tol, rtol=0)
    np.testing.assert_allclose(_cache_values(feeds["past_value"]), v, atol=tol, rtol=0)


TILE = 16  # key_tiles: positions per group of keys held as [D][16]


def _tile(x: np.ndarray) -> np.ndarray:
    """Keys [..., L, D] (L a multiple of 16) as a key_tiles cache holds them: each 16 positions' rows as [D][16]."""
    *lead, L, D = x.shape
    return np.ascontiguousarray(x.reshape(*lead, L // TILE, TILE, D).swapaxes(-1, -2)).reshape(*lead, L, D)


def _untile(x: np.ndarray) -> np.ndarray:
    *lead, L, D = x.shape
    return np.ascontiguousarray(x.reshape(*lead, L // TILE, D, TILE).swapaxes(-1, -2)).reshape(*lead, L, D)


def _tiles_case(case: tuple) -> tuple:
    """The case with its cache length rounded up to a multiple of 16 (what key_tiles needs)."""
    return (*case[:5], -(-case[5] // TILE) * TILE, *case[6:])


def _check_key_tiles(library: Path, tmp_path: Path, name: str, cache: str) -> None:
    """The case with key_tiles = 1 (its cache length rounded up to 16) against the reference: the output, and the
    cache, untiled, holding the new keys at their positions and every other position as it was."""
    case = _tiles_case(CASES[name])
    rope = name != "odd-head-size"
    feeds, (out, k, v) = _inputs(case, cache, rope)
    feeds["past_key"] = _tile(feeds["past_key"])
    got = _run_in_place(library, tmp_path, case, cache, rope, feeds, key_tiles=1)
    tol = {"fp32": 2e-5, "fp16": 3e-3 if case[4] <= 256 else 1e-2}[cache]
    np.testing.assert_allclose(got, out, atol=tol, rtol=0)
    np.testing.assert_allclose(_untile(feeds["past_key"]).astype(np.float64), k, atol=tol, rtol=0)
    np.testing.assert_allclose(feeds["past_value"].astype(np.float64), v, atol=tol, rtol=0)


@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
@pytest.mark.parametrize("cache", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_key_tiles_match_reference_in_place(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            name: str, cache: str, generic: bool) -> None:
    """key_tiles = 1: the keys of every 16 positions held as [D][16]. Decode rows and short prompts score 16 keys
    a product straight from the cache's groups; prompts of 32 positions or more widen the groups into their packed
    keys (AMX tiles' or fp32's), where the row layout transposed its rows; the portable path reads a key's dims 16
    apart."""
    monkeypatch.setenv("LLMC_KERNELS_GENERIC", "1" if generic else "0")
    _check_key_tiles(library, tmp_path, name, cache)


@pytest.mark.parametrize("cache", ["fp32", "fp16"])
@pytest.mark.parametrize("name", PROMPT_PATH_CASES)
def test_key_tiles_prompts_without_packed_keys_match_reference(library: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch, name: str,
                                                               cache: str) -> None:
    """Prompts of 32 positions or more with neither AMX tiles nor packed keys (LLMC_KERNELS_NO_AMX,
    LLMC_KERNELS_NO_PACKED_KEYS) score their blocks of up to 16 query vectors from the cache's groups as decode
    rows do."""
    monkeypatch.setenv("LLMC_KERNELS_NO_AMX", "1")
    monkeypatch.setenv("LLMC_KERNELS_NO_PACKED_KEYS", "1")
    _check_key_tiles(library, tmp_path, name, cache)


@pytest.mark.parametrize(("cache", "length", "attrs", "message"), [
    ("fp16", 32, {"key_tiles": 2}, r"key_tiles 2: must be 0 \(rows\) or 1"),
    ("int8", 32, {"key_tiles": 1}, "key_tiles 1: an fp32 or fp16 cache only"),
    ("fp16", 40, {"key_tiles": 1}, "key tiles: cache length 40 must be a multiple of 16"),
])
def test_bad_key_tiles_are_refused_naming_them(library: Path, tmp_path: Path, cache: str, length: int, attrs: dict,
                                               message: str) -> None:
    case = (*CASES["chunk-after-past"][:5], length, *CASES["chunk-after-past"][6:])
    feeds, _ = _inputs(case, cache, True)
    with pytest.raises(Exception, match=message):
        session = _session(library, _graph(tmp_path / "a.onnx", case[2], case[3], cache, True, **attrs))
        session.run(None, feeds)  # type: ignore[attr-defined]


@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
def test_int8_cache_keys_with_a_few_large_channels_keep_their_scores(library: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       generic: bool) -> None:
    """Keys whose few large channels would set their int8 groups' scales (what the rotary leaves in a real model's
    keys) lose less through the cache than rows rounded as they are: the cache holds each key times a 32-point
    Hadamard matrix, which spreads those channels over their group, and the queries meet them through the same one."""
    monkeypatch.setenv("LLMC_KERNELS_GENERIC", "1" if generic else "0")
    B, S, H, Hkv, D = 1, 40, 6, 2, 64
    rng = np.random.default_rng(7)
    qkv = rng.standard_normal((B, S, (H + 2 * Hkv) * D)).astype(np.float32)
    keys = qkv[..., H * D:(H + Hkv) * D].reshape(B, S, Hkv, D)
    keys[..., [3, 37]] *= 25.0  # two large channels a head, one in each group of 32
    qkv[..., H * D:(H + Hkv) * D] = keys.reshape(B, S, Hkv * D)
    empty = np.zeros((B, Hkv, S, D + 4), np.int8)
    feeds = {"qkv": qkv, "past_key": empty, "past_value": empty.copy(),
             "seqlens_k": np.array([S - 1], np.int32), "total_sequence_length": np.array(S, np.int32)}
    got = _run_in_place(library, tmp_path, (B, S, H, Hkv, D, S, [0], [S], True), "int8", False, feeds)
    exact, k, _ = _reference(qkv, np.zeros((B, Hkv, S, D)), np.zeros((B, Hkv, S, D)), [0], [S], H, Hkv, None, None)
    np.testing.assert_allclose(_cache_values(feeds["past_key"], keys=True), k, atol=0.3, rtol=0)
    # the same attention over keys and values rounded to int8 rows as they are (no Hadamard matrix)
    rounded = qkv.copy()
    kv = rounded[..., H * D:].reshape(B, S, 2 * Hkv, D)
    rounded[..., H * D:] = _cache_values(_quantize_rows(kv)).reshape(B, S, 2 * Hkv * D)
    plain, _, _ = _reference(rounded, np.zeros((B, Hkv, S, D)), np.zeros((B, Hkv, S, D)), [0], [S], H, Hkv, None,
                             None)
    err, err_plain = np.abs(got - exact).mean(), np.abs(plain - exact).mean()
    assert err < 0.5 * err_plain, (err, err_plain)


@pytest.mark.parametrize("cache", ["fp32", "int8"])
@pytest.mark.parametrize("name", [n for n in CASES if n != "odd-head-size"])
def test_keys_are_rotated_into_the_cache_to_the_same_bits_on_every_path(library: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        name: str, cache: str) -> None:
    """The rotary on AVX-512 (16 dims at a time) rounds each product, difference and sum as the portable C does:
    an fp32 cache holds the same bits from either path, full and partial rotary, prompts and decode rows; an int8
    cache the same rows and scales (its keys' Hadamard matrix passes over them in the same order on both paths). A
    CPU without AVX-512 runs the portable C both times."""
    from llmc.engines.kernels import cpu_paths

    case, keys = CASES[name], {}
    for generic in (False, True):
        monkeypatch.setenv("LLMC_KERNELS_GENERIC", "1" if generic else "0")
        if generic:
            assert cpu_paths()["attention"] == "portable"
        feeds, _ = _inputs(case, cache, True)
        _run_in_place(library, tmp_path, case, cache, True, feeds)
        keys[generic] = feeds["past_key"]
    np.testing.assert_array_equal(keys[False], keys[True])


@pytest.mark.parametrize("cache", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("name", ["decode-split-rows", "decode-d64-6-heads", "decode-window-split-rows-softcap"])
def test_key_prefetches_into_l1_or_l2_change_no_bit(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     name: str, cache: str) -> None:
    """Decode rows over long caches: where the keys' prefetches go (prefetch.h; LLMC_PREFETCH picks either on any
    CPU) changes nothing in the output or the cache."""
    from llmc.engines.kernels import cpu_paths

    case, got = CASES[name], {}
    for level in ("l1", "l2"):
        monkeypatch.setenv("LLMC_PREFETCH", level)
        assert cpu_paths()["prefetch"] == level
        feeds, (out, _, _) = _inputs(case, cache, True)
        got[level] = (_run_in_place(library, tmp_path, case, cache, True, feeds), feeds["past_key"].copy())
    np.testing.assert_array_equal(got["l1"][0], got["l2"][0])
    np.testing.assert_array_equal(got["l1"][1], got["l2"][1])
    np.testing.assert_allclose(got["l2"][0], out, atol={"fp32": 2e-5, "fp16": 3e-3, "int8": 5e-2}[cache], rtol=0)



def _outputs_under(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, cache: str,
                   seed: int, variable: str) -> list[np.ndarray]:
    """The case's output with `variable` at "0", then at "1" (a path choice the op reads at each call)."""
    case = CASES[name]
    feeds, _ = _inputs(case, cache, True, seed=seed)
    graph = _graph(tmp_path / "a.onnx", case[2], case[3], cache, True,
                   new_tokens=bool(_options(case).get("new_tokens")), **_attrs(case))
    outs = []
    for value in ("0", "1"):
        monkeypatch.setenv(variable, value)
        outs.append(_session(library, graph).run(None, feeds)[0])  # type: ignore[attr-defined]
    return outs


@pytest.mark.parametrize("cache", ["fp16", "int8"])
@pytest.mark.parametrize("name", PROMPT_PATH_CASES)
def test_prompt_tiles_agree_with_the_fp32_scores(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 name: str, cache: str) -> None:
    """A prompt's scores and weighted sums on AMX-BF16 tiles (q, k, weights and values as bf16 hi + lo), where the
    CPU grants them, against the same run with LLMC_KERNELS_NO_AMX (fp32 FMAs): within ~1e-5 of the outputs, and
    not bit for bit (the tiles ran); on a CPU without AMX both runs take the FMAs and agree exactly."""
    from llmc.engines.kernels import cpu_paths

    amx = cpu_paths()["matmul_q4"] == "avx512-vnni+amx-bf16"  # (before LLMC_KERNELS_NO_AMX is set)
    tiles, fmas = _outputs_under(library, tmp_path, monkeypatch, name, cache, 3, "LLMC_KERNELS_NO_AMX")
    if amx:
        assert not np.array_equal(tiles, fmas)
        np.testing.assert_allclose(tiles, fmas, atol=2e-5 * np.abs(fmas).max(), rtol=0)
    else:
        np.testing.assert_array_equal(tiles, fmas)


@pytest.mark.parametrize("cache", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("name", PROMPT_PATH_CASES)
def test_prompt_scores_from_packed_keys_agree_with_the_row_loop(library: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch, name: str,
                                                                cache: str) -> None:
    """A prompt's AVX-512 scores from keys packed 16 at a time (head sizes up to 128, no AMX tiles) against the
    row-by-row loop (LLMC_KERNELS_NO_PACKED_KEYS): the same to ~1e-6 of the outputs (the products are summed in
    another order), and not bit for bit (the packed keys ran); head size 256, and a CPU without AVX-512 (the
    portable loop), take the same path both times and agree exactly."""
    from llmc.engines.kernels import cpu_paths

    monkeypatch.setenv("LLMC_KERNELS_NO_AMX", "1")
    packed, rows = _outputs_under(library, tmp_path, monkeypatch, name, cache, 4, "LLMC_KERNELS_NO_PACKED_KEYS")
    if CASES[name][4] > 128 or cpu_paths()["attention"] != "avx512":
        np.testing.assert_array_equal(packed, rows)
    else:
        assert not np.array_equal(packed, rows)
        np.testing.assert_allclose(packed, rows, atol=2e-6 * np.abs(rows).max(), rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_plain_run_copies_the_past_into_the_present(library: Path, tmp_path: Path, threads: int) -> None:
    case = CASES["decode-split-rows"]
    feeds, (out, k, v) = _inputs(case, "fp32", True, seed=1)
    before = {n: feeds[n].copy() for n in ("past_key", "past_value")}
    session = _session(library, _graph(tmp_path / "a.onnx", case[2], case[3], "fp32", True), threads)
    got, present_k, present_v = session.run(None, feeds)  # type: ignore[attr-defined]
    np.testing.assert_allclose(got, out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(present_k, k, atol=2e-5, rtol=0)
    np.testing.assert_allclose(present_v, v, atol=2e-5, rtol=0)
    for name, array in before.items():  # inputs are not written when the outputs are ONNX Runtime's own
        np.testing.assert_array_equal(feeds[name], array)


@pytest.mark.parametrize(("name", "rotary"), [("prompt-window-partial-rotary", 8),
                                              ("decode-window-split-rows-softcap", 16),
                                              ("chunk-after-past-window-softcap", 8),  # GQA: R a multiple of 8
                                              ("decode-split-rows-sinks", 32),  # sinks: GQA's head_sink
                                              ("prompt-d64-blocks-window-sinks", 32)])
def test_window_softcap_and_partial_rotary_match_group_query_attention(library: Path, tmp_path: Path, name: str,
                                                                       rotary: int) -> None:
    case = CASES[name]
    (B, _, H, Hkv), (past, new) = case[:4], case[6:8]
    feeds, (out, k, v) = _inputs(case, "fp32", True, seed=2, rotary=rotary)
    sinks = bool(_options(case).get("sinks"))
    sessions = [_session(library, _graph(tmp_path / f"{op}.onnx", H, Hkv, "fp32", True, op, sinks=sinks,
                                         **_attrs(case))) for op in ("GroupQueryAttention", "")]
    results = [session.run(None, feeds) for session in sessions]  # type: ignore[attr-defined]
    for b in range(B):  # the valid query rows, and the cache up to each row's last position
        n, end = new[b], past[b] + new[b]
        for got_out, got_k, got_v in results:
            np.testing.assert_allclose(got_out[b, :n], out[b, :n], atol=2e-5, rtol=0)
            np.testing.assert_allclose(got_k[b, :, :end], k[b, :, :end], atol=2e-5, rtol=0)
            np.testing.assert_allclose(got_v[b, :, :end], v[b, :, :end], atol=2e-5, rtol=0)


@pytest.mark.parametrize(("attrs", "width", "message"), [
    ({"local_window_size": 0}, 8, r"local_window_size 0: must be -1 \(no window\) or at least 1"),
    ({"local_window_size": -2}, 8, "local_window_size -2: must be -1"),
    ({"softcap": -1.0}, 8, r"softcap -1: must be 0 \(off\) or positive"),
    ({}, 9, r"cos_cache \[43, 9\] and sin_cache \[43, 9\] must both be \[max_pos, R\] with 1 <= R <= D/2 = 8"),
])
def test_a_bad_window_softcap_or_rotary_width_is_refused_naming_it(library: Path, tmp_path: Path, attrs: dict,
                                                                   width: int, message: str) -> None:
    case = CASES["chunk-after-past"]  # D = 16
    feeds, _ = _inputs(case, "fp32", True)
    feeds["cos"] = feeds["sin"] = np.zeros((43, width), np.float32)
    with pytest.raises(Exception, match=message):
        session = _session(library, _graph(tmp_path / "a.onnx", case[2], case[3], "fp32", True, **attrs))
        session.run(None, feeds)  # type: ignore[attr-defined]


def test_sinks_of_another_head_count_are_refused_naming_it(library: Path, tmp_path: Path) -> None:
    case = CASES["decode-split-rows-sinks"]  # H = 6
    feeds, _ = _inputs(case, "fp32", True)
    feeds["sinks"] = np.zeros(5, np.float32)
    session = _session(library, _graph(tmp_path / "a.onnx", case[2], case[3], "fp32", True, sinks=True))
    with pytest.raises(Exception, match=r"sinks must be \[H\] with H = 6"):
        session.run(None, feeds)  # type: ignore[attr-defined]


def test_a_row_past_the_cache_is_refused_with_the_limit(library: Path, tmp_path: Path) -> None:
    case = CASES["chunk-after-past"]
    feeds, _ = _inputs(case, "fp32", True)
    feeds["seqlens_k"] = np.array([44], np.int32)  # 45 positions in a 40-position cache
    session = _session(library, _graph(tmp_path / "a.onnx", case[2], case[3], "fp32", True))
    with pytest.raises(Exception, match="row 0 needs 45 positions: the cache holds 40"):
        session.run(None, feeds)  # type: ignore[attr-defined]


def test_an_engine_of_another_operator_version_is_refused_at_load(tiny_llama: Built, tmp_path: Path) -> None:
    import json
    import shutil

    from llmc.engines.registry import load_engine_dir
    from llmc.errors import EngineError, ManifestError

    engine = shutil.copytree(tiny_llama.engine("llmc"), tmp_path / "e")
    data = json.loads((engine / "engine.json").read_text())
    assert data["settings"]["llmc_ops"] == ops_version() and not list(engine.glob("*.so"))
    (engine / "engine.json").write_text(json.dumps({**data, "settings": {**data["settings"], "llmc_ops": "0"}}))
    with pytest.raises(ManifestError, match=f"built with llmc's operators version 0; this installation has version "
                                            f"{ops_version()} \\(it runs versions 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, "
                                            f"16, 17, 18, 19, 20, 21, 22, 23, 24, 25\\): build the engine again"):
        load_engine_dir(engine)
    (engine / "engine.json").write_text(json.dumps({**data, "settings": {**data["settings"], "llmc_ops": "5"}}))
    load_engine_dir(engine)  # versions 6 and 7 only added an optional input and an operator: version 5 runs
    legacy = {k: v for k, v in data["settings"].items() if k != "llmc_ops"} | {"custom_ops": "libllmc_ops.so"}
    (engine / "engine.json").write_text(json.dumps({**data, "settings": legacy}))  # llmc 0.1: a copy in the folder
    with pytest.raises(EngineError, match="libllmc_ops.so is missing"):
        load_engine_dir(engine)


def test_without_the_library_auto_builds_with_onnx_runtime_and_llmc_is_one_line(
        tiny_llama: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmc.engines import kernels
    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.errors import BackendUnavailableError

    def not_built() -> Path:
        raise BackendUnavailableError("llmc's operator library is not built in ...")

    monkeypatch.setattr(kernels, "library_path", not_built)
    monkeypatch.setattr(kernels, "_library", not_built)
    manifest = build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "auto"))
    assert manifest.settings.attention == "gqa" and not manifest.settings.llmc_ops
    with pytest.raises(BackendUnavailableError, match="not built"):
        build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "e", attention="llmc"))
    assert not (tmp_path / "e").exists()


def test_cache_dtype_with_attention_auto_builds(tiny_llama: Built, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-dtype int8 with the attention left to auto (llmc's, on an AVX-512 CPU) builds: the fallback to ONNX
    Runtime's operators, which cannot take that cache, is only looked for when the engine diverges (it was resolved
    first, and its error ended every such build after the engine had been built)."""
    from llmc.engines.ort import config
    from llmc.engines.ort.build import BuildConfig, build_ort

    paths = dict(config._cpu_paths(), attention="avx512")
    monkeypatch.setattr(config, "_cpu_paths", lambda: paths)
    manifest = build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "e", kv_dtype="int8"))
    assert manifest.settings.attention == "llmc" and manifest.kv.dtype == "int8"


# --- engines built with --attention llmc (tiny llama); the parity tests run the fp32-cache build as layout "llmc"


@pytest.mark.parametrize(("kv_dtype", "row_bytes", "tol"), [("float16", 2 * 16, 2e-2), ("int8", 16 + 2, 5e-2)])
def test_smaller_cache_engine_matches_the_fp32_cache_engine(tiny_llama: Built, tmp_path: Path, kv_dtype: str,
                                                           row_bytes: int, tol: float) -> None:
    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.engines.registry import load_engine_dir

    manifest = build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "e", attention="llmc", kv_dtype=kv_dtype))
    assert manifest.kv.dtype == kv_dtype and manifest.settings.llmc_ops == ops_version()
    assert manifest.settings.parity["top1_agreement"] == 1.0
    engines = [load_engine_dir(tiny_llama.engine("llmc")), load_engine_dir(tmp_path / "e")]
    # tiny llama: head size 16; a row is 16 fp32 = 64 bytes, 16 fp16, or 16 int8 + one fp16 scale
    assert engines[1].kv_bytes_per_token() * 64 == engines[0].kv_bytes_per_token() * row_bytes
    prompts = [[5, 9, 11, 3, 7, 2], [4, 8]]
    logits = []
    for engine in engines:
        kv = engine.new_kv_cache(2, 64)
        steps = [engine.prefill([0, 1], prompts, kv)]
        for t in range(6):
            steps.append(engine.decode([0, 1], [[3 + t], [20 - t]], kv))
        logits.append(np.stack(steps))
    scale = np.abs(logits[0]).max()
    assert np.abs(logits[1] - logits[0]).max() < tol * scale
    assert (logits[1].argmax(-1) == logits[0].argmax(-1)).all()


def test_int4_engine_with_the_llmc_operator_generates(tiny_llama: Built, tmp_path: Path) -> None:
    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.runtime.llm import LLM
    from llmc.runtime.request import SamplingParams

    build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "q4", quant="int4", attention="llmc", kv_dtype="float16",
                          allow_divergence=True, quality_target=0.0))  # (random tiny weights: 4 bits change
    # its greedy answers)
    out = LLM(tmp_path / "q4").generate(["hello there"], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize(("changes", "message"), [
    ({"attention": "gqa", "kv_dtype": "float16"}, "--kv-dtype float16 needs --attention llmc"),
    ({"attention": "flash"}, "--attention must be one of auto, gqa, llmc, onnx, onnx-static, got 'flash'"),
    ({"attention": "onnx", "kv_dtype": "int8"}, "--kv-dtype int8 needs --attention llmc"),
    ({"attention": "llmc", "kv_dtype": "int4"}, "--kv-dtype must be one of auto, float32, float16, int8, got 'int4'"),
    ({"attention": "llmc", "kv_dtype": "float16", "kv_layout": "concat"}, "only --attention llmc \\(in place\\)"),
])
def test_bad_attention_settings_are_refused(tiny_llama: Built, tmp_path: Path, changes: dict, message: str) -> None:
    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.errors import InputError

    with pytest.raises(InputError, match=message):
        build_ort(BuildConfig(tiny_llama.export_dir, tmp_path / "e", **changes))




# --- paged KV memory: block tables over a shared pool


def _paged_graph(path: Path, H: int, Hkv: int, cache: str, rope: bool, **attrs: Any) -> Path:
    """The cache's op over pools [N, Hkv, block_size, row] and a block_table [B, max_blocks] input."""
    kv_type, llmc_op = CACHES[cache]
    pool = ["N", Hkv, "BS", "D"]
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["B", "S", "W"]),
              helper.make_tensor_value_info("past_key", kv_type, pool),
              helper.make_tensor_value_info("past_value", kv_type, pool),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["P", "R"]) for n in ("cos", "sin") if rope]
    inputs.append(helper.make_tensor_value_info("block_table", TensorProto.INT32, ["B", "M"]))
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["B", "S", "HD"]),
               helper.make_tensor_value_info("present_key", kv_type, pool),
               helper.make_tensor_value_info("present_value", kv_type, pool)]
    names = [i.name for i in inputs[:5]] + (["cos", "sin"] if rope else ["", ""]) + ["block_table"]
    node = helper.make_node(llmc_op, names, [o.name for o in outputs], domain="ai.llmc", num_heads=H,
                            kv_num_heads=Hkv, scale=0.3, **attrs)
    model = helper.make_model(helper.make_graph([node], "attn", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.llmc", 1)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return path


def _to_pool(feeds: dict[str, np.ndarray], past: list[int], bs: int,
             rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """Rows' caches [B, Hkv, L, row] scattered into shuffled blocks of a pool (with spare blocks): a block table,
    and the rows' first full blocks shared with row 0 (their contents made equal first). Changes `feeds`."""
    B, L = feeds["past_key"].shape[0], feeds["past_key"].shape[2]
    M = -(-L // bs)
    shared = [0] + [min(past[0], p) // bs for p in past[1:]]
    for name in ("past_key", "past_value"):
        slot = np.concatenate([feeds[name], np.zeros_like(feeds[name][:, :, : M * bs - L])], axis=2)
        for b in range(1, B):
            slot[b, :, : shared[b] * bs] = slot[0, :, : shared[b] * bs]
        feeds[name] = slot
    order = iter(rng.permutation(B * M + 3).tolist())
    table = np.zeros((B, M), np.int32)
    for b in range(B):
        for i in range(M):
            table[b, i] = table[0, i] if i < shared[b] else next(order)
    return table, shared


@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
@pytest.mark.parametrize("cache", ["fp16", "int8", "fp16-key-tiles"])
@pytest.mark.parametrize("name", ["prompt-right-padded", "decode-split-rows", "chunk-after-past",
                                  "decode-window-split-rows-softcap", "prompt-d64-blocks-window-softcap"])
def test_paged_matches_reference_reading_blocks_in_place(library: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch, name: str, cache: str,
                                                         generic: bool) -> None:
    """Block tables over a shuffled pool, rows sharing their prefix blocks: the same output as the reference, the
    new K/V written into the rows' own blocks, shared and spare blocks untouched; fp16-key-tiles: the key pool's
    blocks of 32 hold two groups of 16 keys each as [D][16] (key_tiles)."""
    import onnxruntime as ort

    monkeypatch.setenv("LLMC_KERNELS_GENERIC", "1" if generic else "0")
    tiles = cache.endswith("key-tiles")
    cache = cache.removesuffix("-key-tiles")
    case, bs = CASES[name], 32 if tiles else 16
    (B, _, H, Hkv), (past, new) = case[:4], case[6:8]
    feeds, _ = _inputs(case, cache, True, seed=3)
    table, shared = _to_pool(feeds, past, bs, np.random.default_rng(4))
    opts = _options(case)
    out, k, v = _reference(feeds["qkv"], _cache_values(feeds["past_key"], keys=True),
                           _cache_values(feeds["past_value"]), past, new, H, Hkv, feeds["cos"], feeds["sin"],
                           opts.get("window", 0), opts.get("softcap", 0.0))
    row = feeds["past_key"].shape[-1]
    pools = {}
    for name_in in ("past_key", "past_value"):
        pool = np.random.default_rng(5).integers(-9, 9, (int(table.max()) + 4, Hkv, bs, row)).astype(
            feeds[name_in].dtype)
        for b in range(B):
            for i, block in enumerate(table[b]):
                pool[block] = feeds[name_in][b, :, i * bs:(i + 1) * bs]
        pools[name_in] = _tile(pool) if tiles and name_in == "past_key" else pool
    before = {n: p.copy() for n, p in pools.items()}
    session = _session(library, _paged_graph(tmp_path / "p.onnx", H, Hkv, cache, True, **_attrs(case),
                                             **({"key_tiles": 1} if tiles else {})))
    binding = session.io_binding()  # type: ignore[attr-defined]
    binding.bind_output("out")
    values = []
    for name_in, array in {**feeds, **pools, "block_table": table}.items():
        value = ort.OrtValue.ortvalue_from_numpy(array)
        values.append(value)
        binding.bind_ortvalue_input(name_in, value)
        if name_in in pools:
            binding.bind_ortvalue_output(name_in.replace("past_", "present_"), value)
    session.run_with_iobinding(binding)  # type: ignore[attr-defined]
    if tiles:
        pools["past_key"], before["past_key"] = _untile(pools["past_key"]), _untile(before["past_key"])
    tol = {"fp16": 3e-3, "int8": 4e-2}[cache]  # as in test_matches_reference_in_place
    if cache == "int8" and case[4] == 64 and _options(case).get("window"):
        tol = 6e-2  # as there: a short window's mean of few int8 rows
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], out, atol=tol, rtol=0)
    written = set()
    for name_in, want in (("past_key", k), ("past_value", v)):
        for b in range(B):
            end = past[b] + new[b]
            rows = np.concatenate([pools[name_in][blk] for blk in table[b]], axis=1)[:, :end]
            np.testing.assert_allclose(_cache_values(rows, keys=name_in == "past_key"), want[b, :, :end], atol=tol,
                                       rtol=0)
            written |= {int(table[b, t // bs]) for t in range(past[b], end)}
            assert all(int(table[b, i]) not in written or i >= shared[b] for i in range(shared[b]))
        untouched = [blk for blk in range(len(before[name_in])) if blk not in written]
        np.testing.assert_array_equal(pools[name_in][untouched], before[name_in][untouched])


def test_paged_block_outside_the_pool_is_refused_naming_it(library: Path, tmp_path: Path) -> None:
    case = CASES["chunk-after-past"]
    feeds, _ = _inputs(case, "fp16", True)
    pool = np.zeros((3, case[3], 16, case[4]), np.float16)
    feeds.update(past_key=pool, past_value=pool.copy(), block_table=np.array([[0, 7, 1]], np.int32))  # 22 positions: blocks 0 and 1
    session = _session(library, _paged_graph(tmp_path / "p.onnx", case[2], case[3], "fp16", True))
    with pytest.raises(Exception, match=r"block_table\[0\]\[1\] = 7 is outside the pool of 3 blocks"):
        session.run(None, feeds)  # type: ignore[attr-defined]


def _shared_graph(path: Path, case: tuple, cache: str) -> Path:
    """The case's one-node graph as a layer reading another layer's cache: kv_shared 1, qkv of Q alone, no present
    outputs."""
    model = onnx.load(str(_graph(path, case[2], case[3], cache, True, new_tokens=bool(_options(case).get("new_tokens")),
                                 **_attrs(case), kv_shared=1)))
    node = model.graph.node[0]
    del node.output[1:]
    del model.graph.output[1:]
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("name", ["prompt-right-padded", "decode-split-rows", "chunks-mixed-counts-many-heads",
                                  "prompt-d64"])
def test_a_kv_shared_layer_attends_the_cache_its_source_wrote(library: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, name: str, cache: str,
                                                             generic: bool) -> None:
    """kv_shared (Gemma 4's KV-shared layers): after a layer's node wrote this run's K/V, a node of Q alone over
    that cache attends as the writing node did (the same queries give its output), and writes nothing."""
    monkeypatch.setenv("LLMC_KERNELS_GENERIC", "1" if generic else "0")
    case = CASES[name]
    H, D = case[2], case[4]
    feeds, _ = _inputs(case, cache, True)
    written = _run_in_place(library, tmp_path, case, cache, True, feeds)
    cache_after = {n: feeds[n].copy() for n in ("past_key", "past_value")}
    session = _session(library, _shared_graph(tmp_path / "shared.onnx", case, cache))
    shared = {**feeds, "qkv": np.ascontiguousarray(feeds["qkv"][..., :H * D])}
    got = session.run(None, shared)[0]  # type: ignore[attr-defined]
    np.testing.assert_allclose(got, written, atol=1e-6, rtol=0)
    for n, before in cache_after.items():
        assert np.array_equal(feeds[n], before), f"{n} changed"


def test_kv_shared_with_a_packed_qkv_or_another_value_is_refused_naming_it(library: Path, tmp_path: Path) -> None:
    case = CASES["chunk-after-past"]
    feeds, _ = _inputs(case, "fp32", True)
    session = _session(library, _shared_graph(tmp_path / "shared.onnx", case, "fp32"))
    with pytest.raises(Exception, match=r"qkv width .*\(kv_shared: qkv holds Q alone\)"):
        session.run(None, feeds)  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="kv_shared 2: must be 0"):
        _session(library, _graph(tmp_path / "bad.onnx", case[2], case[3], "fp32", True, kv_shared=2))


INDEX = {"index_topk": 16, "index_local": 4, "index_sink": 2, "index_heads": 2}  # a budget of 22 keys
INDEXED_CASES: dict[str, tuple[Any, ...]] = {  # (B, S, H, Hkv, D, L, past, new, first prompt[, opts])
    # decode rows past the budget (the first split over the threads) beside one under it
    "decode-rows": (3, 1, 6, 2, 64, 300, [280, 5, 40], [1, 1, 1], False),
    # a prompt whose queries cross the budget at its 22nd position, beside a shorter one
    "prompt": (2, 40, 4, 2, 32, 64, [0, 0], [40, 15], True),
    # chunks of different counts after a past
    "chunks": (2, 6, 8, 2, 64, 64, [37, 3], [6, 2], False, {"new_tokens": True}),
}


def _indexed_reference(qkv: np.ndarray, keys: np.ndarray, values: np.ndarray, dense: np.ndarray, past: list[int],
                       new: list[int], H: int, Hkv: int) -> np.ndarray:
    """`dense` with each query past the budget recomputed over its chosen keys (ModelSpec.index_layers): routing
    scores of transformers' own NVFP4 rounding of query heads 0..1 against KV head 0's cached keys, the top 16 by
    score then position, plus the first 2 and the last 4."""
    import torch
    from transformers.models.kolibri1_1.modeling_kolibri1_1 import nvfp4_fake_quantize

    out, D, G = dense.copy(), keys.shape[-1], H // Hkv
    budget = INDEX["index_topk"] + INDEX["index_local"] + INDEX["index_sink"]
    for b in range(len(past)):
        for s in range(new[b]):
            n = past[b] + s + 1
            if n <= budget:
                continue
            q = qkv[b, s, :H * D].reshape(H, D).astype(np.float64)
            routing = nvfp4_fake_quantize(torch.from_numpy(qkv[b, s, :2 * D].reshape(2, D))).numpy()
            scores = np.maximum(routing.astype(np.float64) @ keys[b, 0, :n].T, 0).sum(0)
            candidates = range(INDEX["index_sink"], n - INDEX["index_local"])
            chosen = sorted(candidates, key=lambda t: (-scores[t], t))[:INDEX["index_topk"]]
            kept = sorted({*range(INDEX["index_sink"]), *chosen, *range(n - INDEX["index_local"], n)})
            for h in range(H):
                logits = keys[b, h // G, kept] @ q[h] * 0.3
                w = np.exp(logits - logits.max())
                out[b, s, h * D:(h + 1) * D] = (w / w.sum()) @ values[b, h // G, kept]
    return out


@pytest.mark.parametrize("generic", [False, True], ids=["native", "generic"])
@pytest.mark.parametrize("cache", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(INDEXED_CASES))
def test_indexed_attention_chooses_each_querys_keys(library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    name: str, cache: str, generic: bool) -> None:
    """Kolibri 1.1's indexed layers (index_topk ...): a query seeing more keys than the budget attends to its first
    ones, its last ones and those of highest routing score (transformers' NVFP4 rounding of the routing queries);
    the others as without the attributes."""
    monkeypatch.setenv("LLMC_KERNELS_GENERIC", "1" if generic else "0")
    case = INDEXED_CASES[name]
    B, S, H, Hkv, D, L, past, new = case[:8]
    feeds, (dense, _, _) = _inputs(case, cache, False)
    got = _run_in_place(library, tmp_path, case, cache, False, feeds, **INDEX)
    keys, values = _cache_values(feeds["past_key"], keys=True), _cache_values(feeds["past_value"])  # (as written)
    want = _indexed_reference(feeds["qkv"], keys, values, dense, past, new, H, Hkv)
    assert np.abs(want - dense).max() > 0.05  # (the choice changes the outputs)
    np.testing.assert_allclose(got, want, atol=2e-3 if cache == "fp16" else 1e-4, rtol=0)


@pytest.mark.parametrize(("attrs", "rope", "message"), [
    ({**INDEX, "index_heads": 4}, False, r"indexed attention \(topk 16, local 4, sink 2, heads 4\).*at most the 3"),
    (INDEX, True, r"indexed attention .*no rotary"),
    ({**INDEX, "index_topk": -1}, False, r"index_topk -1, .*must be in \[0, 2\^24\]"),
])
def test_a_bad_indexed_attention_is_refused_naming_it(library: Path, tmp_path: Path, attrs: dict, rope: bool,
                                                      message: str) -> None:
    case = INDEXED_CASES["decode-rows"]  # 3 query heads a KV head
    feeds, _ = _inputs(case, "fp32", rope)
    with pytest.raises(Exception, match=message):
        session = _session(library, _graph(tmp_path / "a.onnx", case[2], case[3], "fp32", rope, **attrs))
        session.run(None, feeds)  # type: ignore[attr-defined]
