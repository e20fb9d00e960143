"""transformers (eager, fp32) on the same prompts, in the same run: the peer `--compare-torch` measures.

The model lives in a child process, loaded once: its memory stays out of the engine's peak RSS and its threads
out of the engine's process, and the bench can alternate the two on each configuration (engine, transformers,
engine, ...) so a drift of a shared machine's speed reaches both alike, as the ratio between them needs.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any

from llmc.errors import InputError

SETTLE_S = 0.2  # before and after each transformers run: the other side's spinning threads go back to sleep


class _TokenClock:
    """A `generate` streamer that only timestamps: put() is called with the prompt, then with each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def torch_decode(torch: Any, model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """TTFT and decode tokens/s per sequence of one `generate` call (greedy, no EOS), both timed inside that call:
    the first token's arrival splits prefill from decode (timing a separate forward pass for the prompt and
    subtracting it from the call's total goes wrong on a loaded machine, where the two drift apart)."""
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    kwargs: dict[str, Any] = {"attention_mask": mask, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, **{**kwargs, "attention_mask": mask[:, :8]})
        clock = _TokenClock()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=clock, **kwargs)
    assert out.shape[1] - ids.shape[1] == new_tokens and len(clock.times) == new_tokens + 1
    ttft, decode = clock.times[1] - t0, clock.times[-1] - clock.times[1]  # times[0]: the prompt, before prefill
    return {"torch_ttft_ms": ttft * 1e3, "torch_decode_tok_s_per_seq": (new_tokens - 1) / max(decode, 1e-9)}


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e).strip() else repr(e)


def _serve(conn: Connection, source: str, threads: int) -> None:
    """The child: load the model, say so, then answer ("measure", prompts, new_tokens) until ("stop",)."""
    try:
        import torch

        from llmc.export import sources
    except ImportError:
        conn.send((False, "--compare-torch needs the export extra: pip install 'llmc[export]'"))
        return
    try:
        torch.set_num_threads(threads)
        model = sources.load(sources.resolve(source), attention=None).model  # the backend users get
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        conn.send((False, f"--compare-torch could not load {source}: {_first_line(e)}"))
        return
    conn.send((True, None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            return
        if msg[0] != "measure":
            return
        try:
            conn.send((True, torch_decode(torch, model, msg[1], msg[2])))
        except Exception as e:  # noqa: BLE001
            conn.send((False, f"transformers failed: {_first_line(e)}"))


class TorchPeer:
    """transformers on `source` with `threads` threads in a child process; `measure` runs it on given prompts."""

    def __init__(self, source: str, threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no ONNX Runtime threads forked into it
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, source, threads), daemon=True)
        self._proc.start()
        child.close()
        try:
            self._call(None)
        except BaseException:
            self.close()
            raise

    def measure(self, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
        time.sleep(SETTLE_S)
        result = self._call(("measure", prompts, new_tokens))
        time.sleep(SETTLE_S)
        return result  # type: ignore[no-any-return]

    def _call(self, msg: tuple[Any, ...] | None) -> Any:
        try:
            if msg is not None:
                self._conn.send(msg)
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            raise InputError(f"--compare-torch: the transformers process ended (exit code {self._proc.exitcode})") \
                from None
        if not ok:
            raise InputError(value)
        return value

    def close(self) -> None:
        try:
            self._conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()

    def __enter__(self) -> TorchPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
