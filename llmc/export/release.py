"""Export holds a model's products once: transformers' copy of a decoder layer's weights is let go as soon as the
graphs' own copies of that layer exist.

A checkpoint is loaded in fp32 (a bf16 one upcast: the process's own memory, not the file's pages), and the graphs
take each product transposed ([in, out]) and joined (q, k and v as one; gate and up as one): a second copy of every
layer. Held together they are twice the model (a 3 B model: 2 x 12.4 GB, more than a 24 GB machine). Here each of
the layer's torch parameters that the graphs hold exactly, as a block of columns of one of their arrays, becomes a
view of that block (the same values: compared before), and the state dict's arrays that were views of the old
parameter become views of the new one; the old storage is freed. transformers then computes the golden outputs and
the parity check with the very values the graphs hold. A parameter the graphs hold changed (a folded norm, a rotary
permutation, a scale) keeps its own copy.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

import numpy as np


class LayerRelease:
    """`layer(i, weights)` after the graphs' weights of decoder layer i are made; `dicts`: the state dicts whose arrays
    are views of the model's parameters (renamed copies too), patched to the new views; their arrays of layer i that
    the graphs hold as they are become views of the graphs' too."""

    def __init__(self, model: Any, *dicts: dict[str, np.ndarray]) -> None:
        self.model, self.dicts = model, list(dicts)

    def watch(self, d: dict[str, np.ndarray]) -> None:
        if all(d is not seen for seen in self.dicts):
            self.dicts.append(d)

    def layer(self, i: int, weights: dict[str, np.ndarray]) -> None:
        import torch

        ours = [a for k, a in weights.items() if k.startswith(f"layers.{i}.") and isinstance(a, np.ndarray)
                and a.ndim >= 2 and a.dtype == np.float32 and a.flags.writeable]
        if not ours:
            return
        here = re.compile(rf"(^|\.)(layers|h)\.{i}\.")  # (GPT-2's family names its blocks h.i)
        for name, param in list(self.model.named_parameters()):
            if param.ndim < 2 or param.dtype != torch.float32 or not here.search(name) or param.device.type != "cpu":
                continue
            theirs = param.detach().numpy()
            view = _held_as_columns(theirs, ours)
            if view is None:
                continue
            module_name, _, attr = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            if not isinstance(getattr(module, attr, None), torch.nn.Parameter):
                continue
            old = theirs.__array_interface__["data"][0]
            held = torch.from_numpy(view).transpose(-1, -2)
            setattr(module, attr, torch.nn.Parameter(held, requires_grad=param.requires_grad))
            for d in self.dicts:
                for key, value in d.items():
                    if (isinstance(value, np.ndarray) and value.shape == theirs.shape
                            and value.__array_interface__["data"][0] == old):
                        d[key] = np.swapaxes(view, -1, -2)
        for d in self.dicts:  # (floats made from the parameters, not views of them: a BitNet checkpoint's unpacked or
            # rounded ternary weights)
            for key, value in list(d.items()):
                if (isinstance(value, np.ndarray) and value.ndim >= 2 and value.dtype == np.float32
                        and here.search(key) and not any(np.may_share_memory(value, a) for a in ours)):
                    view = _held_as_columns(value, ours)
                    if view is not None:
                        d[key] = np.swapaxes(view, -1, -2)
        _trim()


def _trim() -> None:
    """Hand the heap's freed pages back to the system: glibc keeps freed blocks under its mmap threshold, which rises
    to 32 MB as large blocks are freed, so a layer's 16 MB products let go would stay the process's (3 B model: 1.5 GB
    by the last layer)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # (not glibc)
        pass


def _held_as_columns(theirs: np.ndarray, ours: list[np.ndarray]) -> np.ndarray | None:
    """The block of columns of one of `ours` ([..., in, width]) that is `theirs` ([..., out, in]: a product, or a
    mixture's experts' stacked) transposed in its last two axes, or None."""
    *lead, out, width_in = theirs.shape
    first = (0,) * (theirs.ndim - 1)
    held = np.swapaxes(theirs, -1, -2)  # (as the graphs would hold it: [..., in, out])
    for a in ours:
        if (a.ndim != theirs.ndim or list(a.shape[:-2]) != lead or a.shape[-2] != width_in or a.shape[-1] < out
                or np.may_share_memory(a, theirs)):
            continue
        row, column = a[first], held[first]
        starts = np.arange(a.shape[-1] - out + 1)
        for j in range(min(out, 64)):  # (narrowed value by value: ternary weights match a third of the columns at each)
            starts = starts[row[starts + j] == column[j]]
            if len(starts) <= 1:
                break
        for s in starts[:8]:
            block = a[..., s:s + out]
            if np.array_equal(block, held):
                return block
    return None
