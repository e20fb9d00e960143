"""Shared fixtures: tiny models of each architecture (HF folder, export, ORT engine) built once per session,
and the default model (SmolLM2-135M-Instruct) exported and built once for the slow tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tiny_models import make_model

ARCHS = ("llama", "llama3", "mistral", "ministral", "qwen2", "gpt2", "gpt_bigcode", "opt", "qwen3", "seed_oss",
         "gemma", "gemma2", "gemma3_text", "phi", "phi3", "smollm3", "cohere", "nemotron", "arcee", "glm", "glm4",
         "helium", "ernie4_5", "exaone4", "olmo", "stablelm", "gpt_neox", "starcoder2", "olmo2", "granite",
         "granitemoe", "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "olmo3", "glm4_moe", "dots1", "olmoe",
         "cohere2", "ernie4_5_moe", "hunyuan_v1_dense", "hunyuan_v1_moe", "deepseek_v2", "deepseek_v3",
         "glm4_moe_lite", "falcon", "falcon_mqa", "falcon_seq", "gptj", "minimax_m2",
         "ministral3", "apertus", "afmoe", "cwm", "vaultgemma", "granitemoeshared", "nanochat", "solar_open",
         "exaone", "minicpm3", "flex_olmo", "exaone_moe", "granite_swa", "granitemoe_swa", "hyperclovax", "jais2",
         "youtu", "minicpm5_moe", "mellum", "flint", "hy_v3", "kolibri1", "dbrx", "cohere2_moe", "phimoe", "llama4_text",
         "deepseek_v32", "glm_moe_dsa", "axk1", "mimo_v2_flash", "laguna", "lfm2", "lfm2_moe", "lfm3",
         "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lara_mini", "granitemoehybrid", "granitemoehybrid_dense",
         "bamba", "nemotron_h", "falcon_h1", "falcon_h1_normed", "kimi_linear",
         "olmo_hybrid", "nemotron_h_moe", "mamba2", "nemotron_h_latent", "mamba", "falcon_mamba", "jamba", "zamba2",
         "gemma4_text", "gemma4_e", "gemma4_moe", "apertus1p5_text", "jetmoe", "kolibri1_1", "bitnet")
# Engines the parity tests run on (each exact to 1e-4): in place with GroupQueryAttention, the export's own graphs
# (KV layout "concat"), in place with standard ONNX Attention + TensorScatter, and in place with llmc's own attention
# operator over an fp32 cache (the library is built when llmc is installed), and "onnx-static": Attention over the
# whole buffer under a [B, 1, S, max_seq] mask (what TensorRT's native attention is built from). "default" (what
# `llmc build` picks: on a CPU with AVX-512, llmc's operator over an fp16 cache) is checked against the fp32-cache
# engine elsewhere.
LAYOUTS = ("gqa", "concat", "onnx", "llmc", "onnx-static")


@dataclass(frozen=True)
class Built:
    """A model at every stage: its source, its export folder and its ONNX Runtime engine folder."""

    name: str
    hf_dir: Path  # the model reference passed to export (an HF folder, or the default model's name)
    export_dir: Path
    engine_dir: Path  # `llmc build` with its defaults
    gqa_engine_dir: Path | None = None  # in place with GroupQueryAttention, tiny models only
    concat_engine_dir: Path | None = None  # the export's own graphs (KV layout "concat"), tiny models only
    onnx_engine_dir: Path | None = None  # in place with Attention-24 + TensorScatter, tiny models only
    llmc_engine_dir: Path | None = None  # in place with llmc's attention operator, tiny models only
    onnx_static_engine_dir: Path | None = None  # in place, Attention over the whole buffer, tiny models only

    def engine(self, layout: str) -> Path:
        """The engine folder for "default", "gqa", "concat", "onnx", "llmc" or "onnx-static"."""
        path = {"default": self.engine_dir, "gqa": self.gqa_engine_dir, "concat": self.concat_engine_dir,
                "onnx": self.onnx_engine_dir,
                "llmc": self.llmc_engine_dir, "onnx-static": self.onnx_static_engine_dir}[layout]
        assert path is not None, f"no {layout} engine for {self.name}"
        return path


def _export_and_build(ref: str, root: Path) -> tuple[Path, Path]:
    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.export.exporter import ExportConfig, export

    export_dir, engine_dir = root / "export", root / "engine"
    export(ExportConfig(model=ref, out_dir=export_dir))
    build_ort(BuildConfig(export_dir, engine_dir, force=True))
    return export_dir, engine_dir


@pytest.fixture(scope="session")
def llmc_ops() -> Path:
    """llmc's operator library (llmc/engines/kernels), as the installation built it."""
    from llmc.engines.kernels import library_path

    return library_path()


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    """tiny_factory(arch) -> Built, made on first use and cached for the session."""
    from llmc.engines.ort.build import BuildConfig, build_ort

    cache: dict[str, Built] = {}

    def get(arch: str) -> Built:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"tiny-{arch}")
            hf_dir = make_model(arch, root / "hf")
            export_dir, engine_dir = _export_and_build(str(hf_dir), root)
            gqa, concat, onnx_attention = root / "engine-gqa", root / "engine-concat", root / "engine-onnx"
            build_ort(BuildConfig(export_dir, gqa, attention="gqa"))
            build_ort(BuildConfig(export_dir, concat, kv_layout="concat"))
            build_ort(BuildConfig(export_dir, onnx_attention, attention="onnx"))
            llmc_attention = root / "engine-llmc"
            build_ort(BuildConfig(export_dir, llmc_attention, attention="llmc", kv_dtype="float32"))
            onnx_static = root / "engine-onnx-static"
            build_ort(BuildConfig(export_dir, onnx_static, attention="onnx-static"))
            cache[arch] = Built(arch, hf_dir, export_dir, engine_dir, gqa, concat, onnx_attention, llmc_attention,
                                onnx_static)
        return cache[arch]

    return get


@pytest.fixture(scope="session", params=ARCHS)
def tiny(request: pytest.FixtureRequest, tiny_factory: Callable[[str], Built]) -> Built:
    """Each tiny architecture in turn."""
    return tiny_factory(request.param)


@pytest.fixture(scope="session")
def serve_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (with tokenizer and chat template), exported and built once with the defaults: the
    engine the server and deployment tests run."""
    from llmc.engines.ort.build import BuildConfig, build_ort
    from llmc.export.exporter import ExportConfig, export

    root = tmp_path_factory.mktemp("serve-tiny")
    hf = make_model("llama", root / "hf")
    export(ExportConfig(str(hf), root / "export"))
    build_ort(BuildConfig(root / "export", root / "engine", force=True))
    return root / "engine"


@pytest.fixture(scope="session")
def tiny_llama(tiny_factory: Callable[[str], Built]) -> Built:
    return tiny_factory("llama")


@pytest.fixture(scope="session")
def hf_factory() -> Callable[[Built], Any]:
    """hf_factory(built) -> the transformers model (fp32, eval) of a tiny model, loaded once."""
    cache: dict[Path, Any] = {}

    def get(built: Built) -> Any:
        if built.hf_dir not in cache:
            import torch
            from transformers import AutoModelForCausalLM

            if "quantization_config" in (built.hf_dir / "config.json").read_text():  # (BitNet's, as sources.load:
                # its torch.compile'd helpers run eagerly)
                torch._dynamo.config.disable = True
            model = AutoModelForCausalLM.from_pretrained(str(built.hf_dir), dtype=torch.float32,
                                                         attn_implementation="eager")  # as sources.load
            cache[built.hf_dir] = model.eval()
        return cache[built.hf_dir]

    return get


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The default model exported and built once; its GGUF is fetched into (or reused from) $LLMC_CACHE."""
    root = tmp_path_factory.mktemp("smollm2")
    export_dir, engine_dir = _export_and_build("smollm2-135m-instruct", root)
    return Built("smollm2-135m-instruct", Path("smollm2-135m-instruct"), export_dir, engine_dir)
