"""Choices and helpers shared by several commands."""

from __future__ import annotations

from enum import Enum


class Dtype(str, Enum):
    float32 = "float32"
    float16 = "float16"


class Backend(str, Enum):
    ort = "ort"
    trt = "trt"


class Quant(str, Enum):
    none = "none"
    int8 = "int8"
    int4 = "int4"
