"""The choices a build takes, as `str` Enums validated once where a config is made (the CLI takes the same ones).

`auto` values are resolved against the export and this CPU by `ort_build.resolve` into the fastest engine llmc
knows to build there; every other value is the user's explicit choice.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from llmc.errors import InputError


class Backend(str, Enum):
    ort = "ort"
    trt = "trt"
    ort_cuda = "ort-cuda"  # ONNX Runtime's CUDA execution provider over the in-place graphs (fp16, GQA)


class Quant(str, Enum):
    none = "none"
    int8 = "int8"
    int4 = "int4"


class WeightsDtype(str, Enum):
    auto = "auto"  # the export's dtype
    float32 = "float32"
    bfloat16 = "bfloat16"  # bf16 weights through llmc's MatMulBF16, fp32 activations, norms and softmax


class KVLayout(str, Enum):
    inplace = "inplace"  # one [B, Hkv, max_len, D] buffer per layer bound as past and present
    concat = "concat"  # the export's own graphs (past in, past + new out)


class Attention(str, Enum):
    auto = "auto"  # llmc where its AVX-512 path runs and the export is fp32, else gqa (onnx for chunked attention)
    gqa = "gqa"  # com.microsoft.GroupQueryAttention
    llmc = "llmc"  # llmc's CachedAttention operator
    onnx = "onnx"  # standard Attention + TensorScatter (what TensorRT parses)
    onnx_static = "onnx-static"  # the same over the whole buffer, a [B, 1, S, max_seq] mask (TensorRT native)


class KVDtype(str, Enum):
    auto = "auto"  # float16 with llmc attention, else the export's dtype
    float32 = "float32"
    float16 = "float16"
    int8 = "int8"


class MatMul(str, Enum):
    auto = "auto"  # llmc for --quant int4 / int8 where its VNNI or AVX2 path runs, else ort
    ort = "ort"  # MatMulNBits
    llmc = "llmc"  # llmc's MatMulQ4 (4-bit layers) and MatMulQ8 (8-bit ones: the head, raised layers)


class MoELowering(str, Enum):
    auto = "auto"  # standard up to 32 experts, ort beyond
    standard = "standard"  # one branch of MatMuls per expert
    ort = "ort"  # com.microsoft.MoE


E = TypeVar("E", bound=Enum)


def choice(kind: type[E], value: object, flag: str) -> E:
    """`value` as a member of `kind`; anything else is a one-line error naming the flag and the choices."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        names = ", ".join(str(m.value) for m in kind)
        raise InputError(f"{flag} must be one of {names}, got {value!r}") from None
