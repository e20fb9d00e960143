"""A thin ONNX graph builder: named nodes, cached constants, opset-aware helpers."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64,
          "int32": TensorProto.INT32, "bool": TensorProto.BOOL, "int8": TensorProto.INT8}
NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class GraphBuilder:
    """Collects nodes and small constants; large weights are referenced by name and attached by the writer."""

    def __init__(self, opset: int, dtype: str) -> None:
        self.opset = opset
        self.dtype = dtype
        self.onnx_dtype = DTYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.constants: dict[str, onnx.TensorProto] = {}
        self.weights_used: list[str] = []
        self._const_names: dict[tuple[str, bytes, tuple[int, ...]], str] = {}
        self._count = 0

    def _name(self, op_type: str) -> str:
        self._count += 1
        return f"{op_type}_{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs: Any) -> str:
        """Add a node with one output; returns the output name."""
        return self.op_n(op_type, *inputs, outputs=outputs, domain=domain, **attrs)[0]

    def op_n(self, op_type: str, *inputs: str, outputs: int, domain: str = "", **attrs: Any) -> list[str]:
        name = self._name(op_type)
        outs = [f"{name}_out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, domain=domain, **attrs))
        return outs

    def output(self, op_type: str, inputs: list[str], name: str, **attrs: Any) -> str:
        """A node whose output is a graph output with a fixed name."""
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=self._name(op_type), **attrs))
        return name

    def const(self, value: np.ndarray | float | int | list[int], dtype: Any = None) -> str:
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.tobytes(), arr.shape)
        if key not in self._const_names:
            name = f"const_{len(self._const_names)}"
            self.constants[name] = numpy_helper.from_array(arr, name)
            self._const_names[key] = name
        return self._const_names[key]

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64))

    def scalar(self, value: float) -> str:
        """A scalar in the model's compute dtype."""
        return self.const(np.array(value, dtype=NP_DTYPES[self.dtype]))

    def weight(self, name: str) -> str:
        if name not in self.weights_used:
            self.weights_used.append(name)
        return name

    # -- opset-aware helpers ---------------------------------------------------------------------------
    def reduce_mean(self, x: str, axis: int) -> str:
        if self.opset >= 18:
            return self.op("ReduceMean", x, self.ints(axis), keepdims=1)
        return self.op("ReduceMean", x, axes=[axis], keepdims=1)

    def reduce_max(self, x: str, axis: int, keepdims: int = 1) -> str:
        if self.opset >= 18:
            return self.op("ReduceMax", x, self.ints(axis), keepdims=keepdims)
        return self.op("ReduceMax", x, axes=[axis], keepdims=keepdims)

    def unsqueeze(self, x: str, *axes: int) -> str:
        return self.op("Unsqueeze", x, self.ints(*axes))

    def split(self, x: str, sizes: list[int], axis: int = -1) -> list[str]:
        return self.op_n("Split", x, self.ints(*sizes), outputs=len(sizes), axis=axis)

    def zeros(self, shape: str) -> str:
        """Zeros of the compute dtype, of `shape` (a 1-D int64 tensor)."""
        zero = helper.make_tensor("zero", self.onnx_dtype, [1], np.zeros(1, NP_DTYPES[self.dtype]))
        return self.op("ConstantOfShape", shape, value=zero)

    def cast(self, x: str, dtype: str) -> str:
        return self.op("Cast", x, to=DTYPES[dtype])

    def to_float32(self, x: str) -> str:
        return x if self.dtype == "float32" else self.cast(x, "float32")

    def to_compute(self, x: str) -> str:
        return x if self.dtype == "float32" else self.cast(x, self.dtype)

    def dim(self, x: str, axis: int) -> str:
        """Size of one axis of x as a 1-D int64 tensor of length 1."""
        return self.op("Shape", x, start=axis, end=axis + 1)
