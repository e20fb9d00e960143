"""A recording stand-in for the `tensorrt` module: only the calls llmc's builder and engine make, each recorded, so
the CPU tests check what would be asked of TensorRT (flags, preview features, the graphs handed to the parser, the
aliases an engine reports). It builds nothing: `build_serialized_network` returns the parsed file's bytes."""

from __future__ import annotations

import enum
from pathlib import Path
from types import ModuleType
from typing import Any


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class _Flags(enum.IntEnum):
    STRONGLY_TYPED = 0


class _Weak(enum.IntEnum):  # 10.x BuilderFlag members of the weakly typed route (removed in 11.x)
    FP16 = 0
    OBEY_PRECISION_CONSTRAINTS = 1
    TF32 = 2


class _Strong(enum.IntEnum):  # 11.x
    TF32 = 2


class _Preview(enum.IntEnum):
    ALIASED_PLUGIN_IO_10_03 = 1
    RUNTIME_ACTIVATION_RESIZE_10_10 = 2


class _Config:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.preview: dict[Any, bool] = {}
        self.flags: list[Any] = []

    def create_timing_cache(self, data: bytes) -> Any:
        return _Cache(data)

    def set_timing_cache(self, cache: Any, ignore_mismatch: bool) -> bool:
        return True

    def set_flag(self, flag: Any) -> None:
        self.rec.calls.append(("set_flag", flag))
        self.flags.append(flag)

    def set_preview_feature(self, feature: Any, enable: bool) -> None:
        self.rec.calls.append(("set_preview_feature", feature, enable))
        self.preview[feature] = enable

    def add_optimization_profile(self, profile: Any) -> int:
        self.rec.calls.append(("add_optimization_profile", dict(profile.shapes)))
        return 0


class _Cache:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def serialize(self) -> bytes:
        return b"cache"


class _Profile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[Any, ...]] = {}

    def set_shape(self, name: str, lo: Any, opt: Any, hi: Any) -> None:
        self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))


class _Layer:
    """Anything a weakly typed build would touch; setting precision or output types is recorded."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.type = "CAST"
        self.num_outputs = 1

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "precision":
            self.rec.calls.append(("layer.precision", value))
        object.__setattr__(self, name, value)

    def set_output_type(self, j: int, dtype: Any) -> None:
        self.rec.calls.append(("layer.set_output_type", j, dtype))

    def get_output(self, j: int) -> Any:
        return type("T", (), {"dtype": "float32"})()


class _Network:
    def __init__(self, rec: Recorder, flags: int) -> None:
        self.rec, self.flags, self.num_layers = rec, flags, 1
        self.path: Path | None = None

    def get_layer(self, i: int) -> _Layer:
        return _Layer(self.rec)


class _Parser:
    def __init__(self, network: _Network, logger: Any) -> None:
        self.network, self.num_errors = network, 0

    def parse_from_file(self, path: str) -> bool:
        self.network.rec.calls.append(("parse_from_file", path))
        self.network.path = Path(path)
        return True

    def get_error(self, i: int) -> str:
        return ""


class _Builder:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.configs: list[_Config] = []

    def create_builder_config(self) -> _Config:
        config = _Config(self.rec)
        self.configs.append(config)
        return config

    def create_network(self, flags: int = 0) -> _Network:
        self.rec.calls.append(("create_network", flags))
        return _Network(self.rec, flags)

    def create_optimization_profile(self) -> _Profile:
        return _Profile()

    def build_serialized_network(self, network: _Network, config: _Config) -> bytes:
        self.rec.calls.append(("build_serialized_network", network.path, dict(config.preview)))
        assert network.path is not None
        return network.path.read_bytes()


def fake_tensorrt(version: str = "11.4.0") -> tuple[ModuleType, Recorder]:
    """(module, recorder) for a TensorRT release: 10.x carries the weakly typed builder flags, 11.x does not."""
    rec = Recorder()
    trt = ModuleType("tensorrt")
    trt.__version__ = version  # type: ignore[attr-defined]
    trt.float32, trt.float16 = "float32", "float16"  # type: ignore[attr-defined]

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    trt.Logger = Logger  # type: ignore[attr-defined]
    trt.NetworkDefinitionCreationFlag = _Flags  # type: ignore[attr-defined]
    trt.BuilderFlag = _Weak if version.startswith("10.") else _Strong  # type: ignore[attr-defined]
    trt.PreviewFeature = _Preview  # type: ignore[attr-defined]
    trt.LayerType = type("LayerType", (), {"CONSTANT": "CONSTANT", "SHAPE": "SHAPE"})  # type: ignore[attr-defined]
    builders: list[_Builder] = []

    def Builder(logger: Any) -> _Builder:  # noqa: N802 - tensorrt's name
        builder = _Builder(rec)
        builders.append(builder)
        return builder

    trt.Builder = Builder  # type: ignore[attr-defined]
    trt.OnnxParser = _Parser  # type: ignore[attr-defined]
    trt.builders = builders  # type: ignore[attr-defined]
    return trt, rec
