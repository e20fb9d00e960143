"""`llmc package ENGINE_DIR --target ...`: what a platform deploys, written whole into OUT_DIR (or not at all).

Each target is one module with a `write(config, facts, work_dir)` function, found through `TARGETS`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from llmc.errors import InputError
from llmc.manifest import ENGINE_MANIFEST, load_engine
from llmc.outdir import atomic_dir, check_out_dir
from llmc.runtime.config import SERVE_STEP_TOKENS

RUNTIME_OVERHEAD_MB = 512  # the Python process, ONNX Runtime's arenas, the tokenizer, activations

# a container image reference (Docker's grammar): [host[:port]/]path[:tag][@digest], the path in lowercase
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])"
_IMAGE = re.compile(rf"(?:{_HOST}(?::[0-9]+)?/)?{_PATH}(?:/{_PATH})*(?::\w[\w.-]{{0,127}})?"
                    r"(?:@[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[0-9a-fA-F]{32,})?")


class Target(str, Enum):
    docker = "docker"
    triton = "triton"
    kserve = "kserve"
    ray = "ray"


@dataclass(frozen=True)
class PackageConfig:
    """What `llmc package` writes; built once by the CLI."""

    engine_dir: Path
    target: Target
    out_dir: Path
    force: bool = False
    name: str | None = None  # the served model name (and Kubernetes object names); None: the engine folder's
    image: str | None = None  # the container image the manifests run; None: `llmc-<name>:latest`
    port: int = 8000
    threads: int = 0  # engine threads per process (0: the container's cores)
    kv_budget_mb: int = 1024
    max_running: int = 8
    replicas: int = 1  # ray / kubernetes: replicas (the minimum when autoscaling)
    max_replicas: int | None = None  # ray: autoscale up to this many
    mount_engine: bool = False  # docker: the engine is mounted at /engine at run time, not copied in

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise InputError(f"--port must be in [1, 65535], got {self.port}")
        for flag, value, low in (("--threads", self.threads, 0), ("--kv-budget-mb", self.kv_budget_mb, 1),
                                 ("--max-running", self.max_running, 1), ("--replicas", self.replicas, 1)):
            if value < low:
                raise InputError(f"{flag} must be >= {low}, got {value}")
        if self.max_running > SERVE_STEP_TOKENS:  # the packaged server would refuse to start
            raise InputError(f"--max-running must be <= {SERVE_STEP_TOKENS} (the tokens per engine step of a packaged "
                             f"server), got {self.max_running}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise InputError(f"--max-replicas ({self.max_replicas}) must be >= --replicas ({self.replicas})")
        if self.name is not None and not _dns_label(self.name):
            raise InputError(f"--name {self.name!r} must be a DNS label: lowercase letters, digits and '-', "
                             "at most 63 characters, starting and ending with a letter or digit")
        if self.target is Target.kserve and not self.served_name[0].isalpha():
            what = f"--name {self.name!r}" if self.name else f"the engine folder's name {self.served_name!r} (--name)"
            raise InputError(f"{what} must start with a letter for --target kserve: Kubernetes Service names are "
                             "DNS-1035 labels")
        if self.image is not None and not (len(self.image) <= 255 and _IMAGE.fullmatch(self.image)):
            raise InputError(f"--image {self.image!r} is not a container image reference: "
                             "[registry[:port]/]lowercase/path[:tag][@digest]")
        for flag, given, targets in _TARGET_OPTIONS:
            if given(self) and self.target not in targets:
                raise InputError(f"{flag} is for --target {' or '.join(t.value for t in targets)}; --target "
                                 f"{self.target.value} does not use it")

    @property
    def served_name(self) -> str:
        return self.name or dns_name(self.engine_dir.resolve().name)

    @property
    def image_ref(self) -> str:
        return self.image or f"llmc-{self.served_name}:latest"


@dataclass(frozen=True)
class EngineFacts:
    """What a deployment needs to know of an engine folder, read from its manifest and its files."""

    model_name: str
    backend: str
    precision: str
    files_bytes: int

    @classmethod
    def read(cls, engine_dir: Path) -> EngineFacts:
        if not (engine_dir / ENGINE_MANIFEST).is_file():
            raise InputError(f"{engine_dir} is not an engine folder (no {ENGINE_MANIFEST}); build one with "
                             "`llmc build`")
        m = load_engine(engine_dir)
        missing = sorted(f for f in m.files if not (engine_dir / f).is_file())
        if missing:
            raise InputError(f"engine folder {engine_dir} lacks {missing[0]}, listed in its {ENGINE_MANIFEST}"
                             f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; rebuild it with "
                             "`llmc build`")
        size = sum(p.stat().st_size for p in engine_dir.rglob("*") if p.is_file())
        return cls(_flat(m.model_name), _flat(m.backend), _flat(m.precision), size)

    def memory_mb(self, kv_budget_mb: int) -> int:
        """Resident memory of one serving process: the engine files (weights are read into memory), the KV
        budget, and the runtime's own."""
        return math.ceil(self.files_bytes / 2**20) + kv_budget_mb + RUNTIME_OVERHEAD_MB


Writer = Callable[[PackageConfig, EngineFacts, Path], list[str]]


def _writers() -> dict[Target, Writer]:
    from llmc.deploy import docker, kserve, ray_config, triton

    return {Target.docker: docker.write, Target.triton: triton.write, Target.kserve: kserve.write,
            Target.ray: ray_config.write}


def package(config: PackageConfig) -> list[str]:
    """Write the target's files into `config.out_dir` (replacing it with --force); returns their paths, relative."""
    engine_dir = Path(config.engine_dir)
    if not engine_dir.is_dir():
        raise InputError(f"engine folder {engine_dir} {'is a file' if engine_dir.exists() else 'does not exist'}")
    facts = EngineFacts.read(engine_dir)
    if facts.backend != "ort" and config.target is not Target.ray:
        raise InputError(f"engine {engine_dir} is a {facts.backend!r} engine; the {config.target.value} target "
                         "packages ONNX Runtime CPU engines ('ort')")
    check_out_dir(config.out_dir, config.force)
    try:
        with atomic_dir(config.out_dir, engine_dir, "engine folder") as work:
            written = _writers()[config.target](config, facts, work)
            (work / "llmc-package.json").write_text(json.dumps({
                "target": config.target.value, "engine": str(engine_dir.resolve()), "model_name": facts.model_name,
                "served_name": config.served_name, "files": sorted(written)}, indent=2) + "\n")
    except OSError as e:  # an output folder that cannot be made or written (read-only, a file in its path, full)
        raise InputError(f"cannot write the package to {config.out_dir}: {e.strerror or e}") from None
    return sorted(written) + ["llmc-package.json"]


def dns_name(text: str) -> str:
    """`text` as a DNS label (Kubernetes object names): lowercase, '-' for anything else, at most 63 chars."""
    out = "".join(c if c.isalnum() and c.isascii() else "-" for c in text.lower()).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    return out[:63].strip("-") or "llmc"


def _flat(text: str) -> str:
    """A manifest's text as the written files' comments quote it: a line break in it would end the comment."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def _dns_label(text: str) -> bool:
    return 0 < len(text) <= 63 and dns_name(text) == text


# The options only some targets use, and how a config says it was given one: set for another target, they are
# refused (they would be dropped without a word)
_TARGET_OPTIONS: tuple[tuple[str, Callable[[PackageConfig], bool], tuple[Target, ...]], ...] = (
    ("--image", lambda c: c.image is not None, (Target.docker, Target.kserve)),
    ("--mount-engine", lambda c: c.mount_engine, (Target.docker,)),
    ("--replicas", lambda c: c.replicas != 1, (Target.kserve, Target.ray)),
    ("--max-replicas", lambda c: c.max_replicas is not None, (Target.kserve, Target.ray)),
)
