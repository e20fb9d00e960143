"""`llmc export` refuses what it cannot or should not export, clearly, and never leaves a half-written folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from conftest import Built
from tiny_models import make_tokenizer
from typer.testing import CliRunner

from llmc.cli.main import app
from llmc.errors import InputError, LlmcError, UnsupportedModelError
from llmc.export.exporter import ExportConfig, export
from llmc.manifest import ExportManifest, load_export


def _export(model: Path | str, out: Path, **kwargs: Any) -> ExportManifest:
    return export(ExportConfig(model=str(model), out_dir=out, **kwargs))


def _cli(*args: object) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args])


def _assert_cli_error(result: Result, *needles: str) -> None:
    """Exit 1, one `error: ...` line on stderr naming each needle, no traceback."""
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert sum(line.startswith("error: ") for line in lines) == 1
    for needle in needles:
        assert needle in lines[-1]
    assert "Traceback" not in result.output


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.partial-"))


@pytest.fixture(scope="module")
def tiny_hf(tiny_factory: Callable[[str], Built]) -> Path:
    return tiny_factory("llama").hf_dir


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


# -- the model reference --------------------------------------------------------------------------------------

def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(InputError, match="does not exist"):
        _export(missing, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == []
    _assert_cli_error(_cli("export", missing, "-o", tmp_path / "out"), "no-such-model", "does not exist")


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        _export(tmp_path / "empty", tmp_path / "out")


def test_unsupported_architecture_is_refused_with_the_list(tmp_path: Path) -> None:
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(UnsupportedModelError) as e:
        _export(folder, tmp_path / "out")
    for name in ("'bert'", "llama", "mistral", "qwen2", "gpt2", "image-text checkpoints: gemma3, mistral3"):
        assert name in str(e.value)
    assert _leftovers(tmp_path, "out") == []
    _assert_cli_error(_cli("export", folder, "-o", tmp_path / "out"), "bert", "supported")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    says = "a GGUF file of architecture 'bert', which llmc does not read"
    with pytest.raises(UnsupportedModelError, match=says):
        _export(path, tmp_path / "out")
    with pytest.raises(UnsupportedModelError, match=says):  # a folder holding one .gguf
        _export(tmp_path, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == []


@pytest.mark.parametrize(("arch", "family"), [("granite-swa", "granite_swa"), ("rwkv7", None)])
def test_a_gguf_llmc_does_not_read_names_the_checkpoint_to_export(tmp_path: Path, arch: str, family: str | None) -> None:
    """A family llmc builds from its Hugging Face checkpoint, whose GGUF files neither llmc nor transformers reads
    (Granite SWA's, written "granite-swa"), is refused pointing at the checkpoint, not as an unknown model type."""
    import gguf
    import numpy as np

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    says = f"architecture '{arch}', which llmc does not read"
    with pytest.raises(UnsupportedModelError, match=says + (f".*builds {family} from its Hugging Face checkpoint"
                                                           if family else "")):
        _export(path, tmp_path / "out")


def test_trust_remote_code_is_refused(tmp_path: Path, tiny_hf: Path) -> None:
    folder = _copy_model(tiny_hf, tmp_path / "remote")
    _edit_config(folder, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with pytest.raises(UnsupportedModelError, match="trust_remote_code"):
        _export(folder, tmp_path / "out")
    _assert_cli_error(_cli("export", folder, "-o", tmp_path / "out"), "trust_remote_code")
    assert _leftovers(tmp_path, "out") == []


@pytest.fixture(scope="module")
def pickle_model(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Path) -> Path:
    """The tiny llama with its weights in pytorch_model.bin (pickle) only."""
    import torch
    from safetensors.torch import load_file

    folder = _copy_model(tiny_hf, tmp_path_factory.mktemp("pickle") / "model")
    state = load_file(str(folder / "model.safetensors"))
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def test_pickle_weights_need_allow_pickle(tmp_path: Path, pickle_model: Path) -> None:
    with pytest.raises(InputError, match="--allow-pickle") as e:
        _export(pickle_model, tmp_path / "out")
    assert "pytorch_model.bin" in str(e.value)
    assert _leftovers(tmp_path, "out") == []
    _assert_cli_error(_cli("export", pickle_model, "-o", tmp_path / "out"), "pickle", "--allow-pickle")
    with pytest.raises(InputError, match="pickle"):  # the .bin file itself, not its folder
        _export(pickle_model / "pytorch_model.bin", tmp_path / "out")


def test_pickle_weights_accepted_with_allow_pickle(tmp_path: Path, pickle_model: Path) -> None:
    result = _cli("export", pickle_model, "-o", tmp_path / "out", "--allow-pickle")
    assert result.exit_code == 0, result.output
    manifest = load_export(tmp_path / "out")
    assert manifest.parity["max_abs_diff"] <= 1e-4
    assert manifest.parity["top1_agreement"] == 1.0


def test_no_weights_at_all(tmp_path: Path, tiny_hf: Path) -> None:
    folder = _copy_model(tiny_hf, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(InputError, match="no weights"):
        _export(folder, tmp_path / "out")


# -- the output folder ----------------------------------------------------------------------------------------

def test_non_empty_output_needs_force(tmp_path: Path, tiny_hf: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="--force"):
        _export(tiny_hf, out)
    assert (out / "keep.txt").read_text() == "mine"
    _assert_cli_error(_cli("export", tiny_hf, "-o", out), "not empty", "--force")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]

    result = _cli("export", tiny_hf, "-o", out, "--force")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("exported ") and len(result.stdout.splitlines()) == 1  # steps go to stderr
    assert not (out / "keep.txt").exists(), "--force replaces the folder, it does not merge into it"
    assert load_export(out).model.num_layers == 2
    assert _leftovers(tmp_path, "out") == ["out"]


def test_empty_output_folder_is_fine(tmp_path: Path, tiny_hf: Path) -> None:
    (tmp_path / "out").mkdir()
    _export(tiny_hf, tmp_path / "out")
    assert (tmp_path / "out" / "llmc.json").is_file()


def test_output_that_is_a_file_is_refused(tmp_path: Path, tiny_hf: Path) -> None:
    (tmp_path / "out").write_text("x")
    with pytest.raises(InputError, match="not a directory"):
        _export(tiny_hf, tmp_path / "out", force=True)


@pytest.fixture(scope="module")
def failing_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama with MLP biases: it resolves fine and fails only once loaded (mid-export)."""
    import torch
    import transformers as tf

    folder = tmp_path_factory.mktemp("failing") / "model"
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, mlp_bias=True)
    tf.LlamaForCausalLM(cfg).save_pretrained(str(folder))
    make_tokenizer(folder, 320)
    return folder


def test_failing_export_leaves_nothing(tmp_path: Path, failing_model: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="bias"):
        _export(failing_model, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == []
    _assert_cli_error(_cli("export", failing_model, "-o", tmp_path / "out"), "bias")
    assert _leftovers(tmp_path, "out") == []


def test_failing_export_with_force_keeps_the_old_export(tmp_path: Path, tiny_hf: Path,
                                                       failing_model: Path) -> None:
    out = tmp_path / "out"
    _export(tiny_hf, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(LlmcError):
        _export(failing_model, out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path, "out") == ["out"]


# -- dtype and opset ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": "bfloat16"}, "--dtype must be float32 or float16, got 'bfloat16'"),
    ({"dtype": "int8"}, "--dtype must be float32 or float16, got 'int8'"),
    ({"opset": 16}, "--opset must be in [17, 21], got 16"),
    ({"opset": 22}, "--opset must be in [17, 21], got 22"),
])
def test_dtype_and_opset_out_of_range(tmp_path: Path, tiny_hf: Path, kwargs: dict[str, Any],
                                      message: str) -> None:
    with pytest.raises(InputError) as e:
        _export(tiny_hf, tmp_path / "out", **kwargs)
    assert str(e.value) == message
    assert _leftovers(tmp_path, "out") == []


def test_cli_opset_out_of_range(tmp_path: Path, tiny_hf: Path) -> None:
    _assert_cli_error(_cli("export", tiny_hf, "-o", tmp_path / "out", "--opset", "99"), "--opset", "99", "17")


def test_cli_unknown_dtype(tmp_path: Path, tiny_hf: Path) -> None:
    result = _cli("export", tiny_hf, "-o", tmp_path / "out", "--dtype", "bfloat16")
    assert result.exit_code != 0
    assert "bfloat16" in result.output and "Traceback" not in result.output
    assert _leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("opset", [17, 21])
def test_opset_range_ends_export(tmp_path: Path, tiny_hf: Path, opset: int) -> None:
    manifest = _export(tiny_hf, tmp_path / "out", opset=opset)
    assert manifest.opset == opset
    assert manifest.parity["max_abs_diff"] <= 1e-4


def test_float16_export(tmp_path: Path, tiny_hf: Path) -> None:
    manifest = _export(tiny_hf, tmp_path / "out", dtype="float16")
    assert manifest.dtype == "float16" and manifest.kv.dtype == "float16"
    assert manifest.parity["top1_agreement"] >= 0.75



# -- impossible dimensions and damaged weights, found before anything is loaded -----------------------------------

@pytest.mark.parametrize(("changes", "words"), [
    ({"num_hidden_layers": -1}, ["num_hidden_layers must be a positive integer, got -1"]),
    ({"num_attention_heads": 0}, ["num_attention_heads must be a positive integer, got 0"]),
    ({"hidden_size": 66, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": None},
     ["hidden_size (66) must be divisible by num_attention_heads (4)"]),
    ({"num_key_value_heads": 3}, ["multiple of num_key_value_heads (3)"]),
    ({"vocab_size": -5}, ["vocab_size must be a positive integer, got -5"]),
    ({"hidden_size": 2**20, "intermediate_size": 2**22, "head_dim": None},
     ["GiB in fp32", "more than this machine's"]),
    ({"num_hidden_layers": "two"}, ["num_hidden_layers must be a positive integer, got 'two'"]),
    # the values of the model's numbers: were tracebacks from transformers, or exports of NaN logits
    ({"intermediate_size": 0}, ["intermediate_size must be a positive integer, got 0"]),  # was read as missing
    ({"rms_norm_eps": -1e-06}, ["rms_norm_eps must be a positive number, got -1e-06"]),
    ({"rms_norm_eps": "1e-6"}, ["rms_norm_eps must be a positive number, got '1e-6'"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     ["rope_parameters rope_theta must be a positive number, got 0"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}},
     ["rope_parameters rope_theta must be a positive number, got None"]),
    ({"rope_parameters": None, "rope_theta": "10000"}, ["rope_theta must be a positive number, got '10000'"]),
    ({"rope_parameters": {"rope_type": "weird", "rope_theta": 1e4}}, ["rope_type 'weird'", "llmc supports default"]),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": -2.0}},
     ["rope_parameters factor must be a positive number, got -2.0"]),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": "2"}},
     ["rope_scaling factor must be a positive number, got '2'"]),
    ({"rope_parameters": "default"}, ["rope_parameters must be an object, got 'default'"]),
    ({"sliding_window": "8"}, ["sliding_window must be a non-negative integer or null, got '8'"]),
])
def test_impossible_config_values_are_named_before_loading(tmp_path: Path, tiny_hf: Path,
                                                            changes: dict[str, Any], words: list[str]) -> None:
    folder = _copy_model(tiny_hf, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(InputError) as e:
        _export(folder, tmp_path / "out")
    assert "config.json" in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    _assert_cli_error(_cli("export", folder, "-o", tmp_path / "out2"), "config.json", *words)


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_family(arch) -> a tiny random model of that family, made once."""
    from tiny_models import make_model

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_model(arch, tmp_path_factory.mktemp(arch) / "hf")
        return made[arch]

    return get


@pytest.mark.parametrize(("arch", "changes", "words"), [
    # were tracebacks from llmc's mixture block, or a model too large for the machine taken for a small one
    ("gpt_oss", {"swiglu_limit": -1.0}, ["swiglu_limit must be a positive number, got -1.0"]),
    ("gpt_oss", {"swiglu_alpha": "1.7"}, ["swiglu_alpha must be a positive number, got '1.7'"]),
    ("gpt_oss", {"num_experts_per_tok": 5}, ["num_experts_per_tok (5) must be at most num_local_experts (4)"]),
    ("gpt_oss", {"num_local_experts": 0.5}, ["num_local_experts must be a positive integer, got 0.5"]),
    ("gpt_oss", {"hidden_size": 4096, "num_local_experts": 4096, "intermediate_size": 8192},
     ["GiB in fp32", "more than this machine's"]),  # the experts count: 400 B parameters, not 0.5 B
    # were tracebacks from transformers' latent attention modules
    ("deepseek_v3", {"kv_lora_rank": 0}, ["kv_lora_rank must be a positive integer, got 0"]),
    ("deepseek_v3", {"qk_rope_head_dim": 7}, ["qk_rope_head_dim must be even (rotated in pairs), got 7"]),
    ("deepseek_v3", {"q_lora_rank": -32}, ["q_lora_rank must be a positive integer, got -32"]),
    ("deepseek_v3", {"v_head_dim": "16"}, ["v_head_dim must be a positive integer, got '16'"]),
    # Nemotron-H's blocks, counted by its pattern where num_hidden_layers is not given
    ("nemotron_h", {"hybrid_override_pattern": "", "num_hidden_layers": None},
     ["layers_block_type (or hybrid_override_pattern) is missing"]),
    # Mamba-1 alone: its channels (expand x hidden_size) stand in for attention's heads
    ("mamba", {"expand": 0}, ["expand must be a positive integer, got 0"]),
    # Gemma 4's mixture's top k under its own name
    ("gemma4_moe", {"top_k_experts": 5}, ["top_k_experts (5) must be at most num_experts (4)"]),
])
def test_impossible_family_values_are_named_before_loading(tmp_path: Path, tiny_family: Callable[[str], Path],
                                                           arch: str, changes: dict[str, Any],
                                                           words: list[str]) -> None:
    folder = _copy_model(tiny_family(arch), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    _assert_cli_error(_cli("export", folder, "-o", tmp_path / "out"), "config.json", *words)


@pytest.mark.parametrize(("arch", "changes", "words"), [
    ("falcon_mqa", {"alibi": True}, ["config option alibi = True is not supported", "ALiBi"]),
    ("bamba", {"time_step_limit": [0.0, 0.1]}, ["config option time_step_limit = (0.0, 0.1) is not supported",
                                                "not in a decode step"]),
    ("granitemoehybrid", {"hidden_act": "gelu"}, ["config option hidden_act = 'gelu' is not supported",
                                                  "Mamba-2 convolution is built with SiLU"]),
    ("falcon_mamba", {"hidden_act": "gelu"}, ["config option hidden_act = 'gelu' is not supported",
                                              "Mamba-1 convolution is built with SiLU"]),
])
def test_family_options_llmc_does_not_build_are_named(tmp_path: Path, tiny_family: Callable[[str], Path], arch: str,
                                                      changes: dict[str, Any], words: list[str]) -> None:
    folder = _copy_model(tiny_family(arch), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    _assert_cli_error(_cli("export", folder, "-o", tmp_path / "out"), *words)


def test_per_layer_embeddings_for_fewer_tokens_than_the_vocabulary_are_refused() -> None:
    """Gemma 4's per-layer embeddings must cover every token the head can pick: a table for fewer would leave a
    generated token without one (transformers fails there), so the export refuses it by name."""
    import transformers as tf

    from llmc.errors import UnsupportedModelError
    from llmc.export.arch import from_transformers

    config = tf.Gemma4TextConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                                 hidden_size_per_layer_input=8, vocab_size_per_layer_input=100,
                                 layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    with pytest.raises(UnsupportedModelError, match=r"vocab_size_per_layer_input = 100 is not supported: per-layer "
                                                    r"embeddings for fewer tokens than the vocabulary \(320\)"):
        from_transformers(tf.AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("damage", ["garbage", "short", "offsets"])
def test_a_safetensors_file_that_is_not_one_is_named(tmp_path: Path, tiny_hf: Path, damage: str) -> None:
    folder = _copy_model(tiny_hf, tmp_path / "m")
    weights = next(folder.glob("*.safetensors"))
    raw = weights.read_bytes()
    if damage == "garbage":
        weights.write_bytes(b"\x89PNG\r\n\x1a\n" + raw[8:200])
    elif damage == "short":
        weights.write_bytes(raw[: len(raw) // 2])
    else:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"] = [0, 10**12]
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        weights.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    _assert_cli_error(_cli("export", folder, "-o", tmp_path / "out"), weights.name)


@pytest.mark.parametrize(("changes", "words"), [
    # weights the config has no place for, or places left random: were exported without a word
    ({"num_hidden_layers": 3}, ["does not match the weights", "missing from the weights",
                                "model.layers.2.", "num_hidden_layers"]),
    ({"num_hidden_layers": 1}, ["does not match the weights", "past the config's layers", "model.layers.1."]),
    # were tracebacks from transformers
    ({"vocab_size": 100}, ["does not match the weights", "model.embed_tokens.weight is [320, 64] in the weights, "
                                                         "[100, 64] by the config"]),
    ({"hidden_act": "swish2"}, ["transformers cannot build the model", "KeyError", "swish2"]),
    # was blamed on the tokenizer
    ({"tie_word_embeddings": "yes"}, ["transformers refuses it", "tie_word_embeddings", "'yes'"]),
])
def test_a_config_that_does_not_fit_its_weights_is_named(tmp_path: Path, tiny_hf: Path, changes: dict[str, Any],
                                                         words: list[str]) -> None:
    folder = _copy_model(tiny_hf, tmp_path / "m")
    _edit_config(folder, **changes)
    with pytest.raises(InputError) as e:
        _export(folder, tmp_path / "out")
    assert "config.json" in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    assert "tokenizer" not in str(e.value) and "\n" not in str(e.value)
    assert _leftovers(tmp_path, "out") == []


def test_a_weight_the_model_has_no_place_for_is_dropped_with_a_warning(tmp_path: Path, tiny_hf: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An extra tensor outside the layers (a buffer an older transformers saved) is not a mismatch: exported."""
    from safetensors.numpy import load_file, save_file

    folder = _copy_model(tiny_hf, tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    weights["model.spare.weight"] = weights["model.norm.weight"].copy()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="llmc.export.sources"):
        _export(folder, tmp_path / "out")
    assert "1 weights the model has no place for are dropped, the first model.spare.weight" in caplog.text


def test_weights_that_make_nan_fail_the_export(tmp_path: Path, tiny_hf: Path) -> None:
    """A NaN difference compared false with the tolerance: an export of NaN logits passed its parity check."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    folder = _copy_model(tiny_hf, tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"][0] = np.nan
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LlmcError, match="the logits are not finite"):
        _export(folder, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == []


def test_a_context_shorter_than_the_golden_check_is_named(tmp_path: Path, tiny_hf: Path) -> None:
    """Was `LimitError: sequence in slot 0 needs 23 positions, KV cache holds 4`, naming no config field."""
    folder = _copy_model(tiny_hf, tmp_path / "m")
    _edit_config(folder, max_position_embeddings=4)
    with pytest.raises(InputError, match=r"max_position_embeddings 4 is less than the golden check needs \(\d+ "
                                         r"prompt tokens \+ 8\)"):
        _export(folder, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == []


@pytest.fixture(scope="module")
def loud_head(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its (tied) embeddings times 3e4: logits ~1e5, where fp32's own rounding moves them by
    ~1e-2 (transformers' and the export's alike), past the export's 1e-3 check against transformers' fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = _copy_model(tiny_hf, tmp_path_factory.mktemp("loud") / "hf")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3e4)
    model.save_pretrained(str(folder))
    return folder


def test_a_model_whose_own_fp32_is_off_is_checked_against_float64(loud_head: Path, tmp_path: Path) -> None:
    """Past 1e-3 from transformers' fp32 logits, the export is measured against its float64 ones: no further than
    2x transformers' own fp32 error (both recorded in the manifest, and said by the CLI)."""
    manifest = export(ExportConfig(str(loud_head), tmp_path / "out"))
    p = manifest.parity
    assert p["max_abs_diff"] > 1e-3 and p["transformers_fp32_error"] > 1e-3
    assert p["float64_diff"] <= 2 * p["transformers_fp32_error"]
    done = _cli("export", loud_head, "-o", tmp_path / "cli")
    assert done.exit_code == 0 and "vs its float64 logits, where its own fp32 ones are" in done.output


def test_an_export_further_from_float64_than_transformers_is_refused(loud_head: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The same model with the export's logits moved by 1.0 (as a wrong graph would move them): refused, naming both
    distances; and where float64 cannot be measured, refused saying so."""
    from llmc.export import exporter
    from llmc.runtime import verify

    check = verify.check_golden

    def moved(engine: Any, golden: Any) -> dict[str, float]:
        result = check(engine, golden)
        return {**result, "max_abs_diff": result["max_abs_diff"] + 1.0}

    monkeypatch.setattr(verify, "check_golden", moved)
    with pytest.raises(LlmcError, match=r"from its float64 logits, where its own fp32 logits are .* allowed\)"):
        export(ExportConfig(str(loud_head), tmp_path / "out"))
    monkeypatch.setattr(verify, "check_golden", check)
    monkeypatch.setattr(exporter, "_float64_logits", lambda model, golden: None)
    with pytest.raises(LlmcError, match=r"transformers' own fp32 error could not be measured"):
        export(ExportConfig(str(loud_head), tmp_path / "out2"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_a_mixture_the_router_cannot_take_is_refused_in_one_line(tmp_path: Path,
                                                                  tiny_factory: Callable[[str], Built]) -> None:
    """DeepSeek-V3's groups of one expert (a group scores by its two best): was a ValueError's traceback."""
    folder = _copy_model(tiny_factory("deepseek_v3").hf_dir, tmp_path / "m")
    _edit_config(folder, n_group=8, topk_group=4)
    with pytest.raises(UnsupportedModelError, match="deepseek_v3's mixture of experts is not supported: num_groups "
                                                    "must leave at least 2 experts a group") as e:
        _export(folder, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert _leftovers(tmp_path, "out") == []
