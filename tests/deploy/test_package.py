"""`llmc package` for docker, kserve and ray: the files each target writes, checked with the platforms' own
schemas (KServe's and Kubernetes' SDK models, Ray Serve's config schema), and one-line errors for bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import Result
from typer.testing import CliRunner

from llmc.cli.main import app
from llmc.deploy.package import EngineFacts


def _cli(*args: object) -> Result:
    return CliRunner().invoke(app, ["package", *[str(a) for a in args]])


def _packaged(engine: Path, out: Path, target: str, *flags: object) -> Path:
    result = _cli(engine, "--target", target, "-o", out, *flags)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "llmc-package.json").read_text())
    assert manifest["target"] == target
    assert all((out / f).is_file() for f in manifest["files"])
    return out


def _error(result: Result, *needles: str) -> str:
    assert result.exit_code == 1, result.output
    lines = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_docker_context(deploy_engine_dir: Path, tmp_path: Path) -> None:
    out = _packaged(deploy_engine_dir, tmp_path / "d", "docker", "--name", "tiny", "--port", "8080",
                    "--threads", "2")
    text = (out / "Dockerfile").read_text()
    lines = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert re.match(r"FROM python:3\.\d+-slim", lines[0])
    user = next(x for x in lines if x.startswith("USER "))
    assert user.split()[1].split(":")[0] not in ("0", "root")
    assert lines.index(user) > max(i for i, x in enumerate(lines) if x.startswith("RUN "))  # installs as root first
    health = text[text.index("HEALTHCHECK"):]
    assert "http://127.0.0.1:8080/health" in health.split("\n\n")[0]
    entry = json.loads(next(x for x in lines if x.startswith("ENTRYPOINT ")).removeprefix("ENTRYPOINT "))
    assert entry[:3] == ["llmc", "serve", "/engine"] and entry[entry.index("--port") + 1] == "8080"
    assert entry[entry.index("--host") + 1] == "0.0.0.0" and entry[entry.index("--threads") + 1] == "2"
    assert "COPY --chown=10001:10001 engine/ /engine/" in lines
    engine_files = sorted(p.name for p in (out / "engine").iterdir())
    assert engine_files == sorted(p.name for p in deploy_engine_dir.iterdir())
    reqs = (out / "requirements.txt").read_text().split()
    names = {r.split("==")[0].lower() for r in reqs}
    assert {"onnxruntime", "tokenizers", "numpy", "fastapi", "uvicorn"} <= names
    assert not names & {"torch", "transformers", "accelerate", "safetensors", "gguf"}
    assert all("==" in r for r in reqs)
    wheels = list((out / "wheels").glob("llmc-*.whl"))
    assert len(wheels) == 1 and f"/tmp/wheels/{wheels[0].name}" in text
    ignore = (out / ".dockerignore").read_text().split()
    assert ignore[ignore.index("**"):] == ["**", "!requirements.txt", "!wheels/", "!engine/"]


def test_docker_mounted_engine(deploy_engine_dir: Path, tmp_path: Path) -> None:
    out = _packaged(deploy_engine_dir, tmp_path / "d", "docker", "--mount-engine")
    text = (out / "Dockerfile").read_text()
    assert "VOLUME /engine" in text and "COPY --chown" not in text and not (out / "engine").exists()


_NATIVE = {"str": str, "int": int, "bool": bool, "float": float, "object": object, "datetime": str}


def _deserialize(data: Any, kind: str) -> Any:
    """Build the SDK model named `kind` (KServe's or Kubernetes') from the YAML's data, recursively: a key the model
    does not have, a value of the wrong type, or a missing required field raises."""
    import kserve.models
    from kubernetes.client import models as k8s_models

    kind = kind.strip()
    seq = re.fullmatch(r"[Ll]ist\[(.*)\]", kind)
    if seq:
        assert isinstance(data, list), f"{kind}: {data!r}"
        return [_deserialize(x, seq.group(1)) for x in data]
    mapping = re.fullmatch(r"(?:dict\(|Dict\[)[^,]*, (.*)[)\]]", kind)
    if mapping:
        assert isinstance(data, dict), f"{kind}: {data!r}"
        return {k: _deserialize(v, mapping.group(1)) for k, v in data.items()}
    if kind in _NATIVE:
        assert _NATIVE[kind] is object or isinstance(data, _NATIVE[kind]), f"{kind}: {data!r}"
        return data
    cls = getattr(kserve.models, kind, None) or getattr(k8s_models, kind)
    keys = {v: k for k, v in cls.attribute_map.items()}
    unknown = set(data) - set(keys)
    assert not unknown, f"{kind} has no field {sorted(unknown)}"
    return cls(**{keys[k]: _deserialize(v, cls.openapi_types[keys[k]]) for k, v in data.items()})


def test_kserve_inference_service_and_deployment(deploy_engine_dir: Path, tmp_path: Path) -> None:
    out = _packaged(deploy_engine_dir, tmp_path / "k", "kserve", "--name", "tiny", "--image", "reg.example/llmc:1",
                    "--kv-budget-mb", "256", "--threads", "2", "--replicas", "2", "--max-replicas", "4")
    isvc_dict = yaml.safe_load((out / "inferenceservice.yaml").read_text())
    assert isvc_dict["apiVersion"] == "serving.kserve.io/v1beta1" and isvc_dict["kind"] == "InferenceService"
    isvc = _deserialize(isvc_dict, "V1beta1InferenceService")
    pred = isvc.spec.predictor
    assert (pred.min_replicas, pred.max_replicas) == (2, 4)
    (c,) = pred.containers
    assert c.image == "reg.example/llmc:1" and c.command == ["llmc"] and c.args[:2] == ["serve", "/engine"]
    for probe in (c.readiness_probe, c.liveness_probe):
        assert (probe.http_get.path, probe.http_get.port) == ("/health", 8000)
    facts = EngineFacts.read(deploy_engine_dir)
    want_mb = facts.memory_mb(256)
    assert c.resources.requests == {"cpu": "2", "memory": f"{want_mb}Mi"}
    assert int(c.resources.limits["memory"].removesuffix("Mi")) > want_mb
    assert want_mb > 256 + facts.files_bytes / 2**20  # the weights, the KV budget, and the runtime's own

    dep_dict, svc_dict = yaml.safe_load_all((out / "deployment.yaml").read_text())
    dep = _deserialize(dep_dict, "V1Deployment")
    svc = _deserialize(svc_dict, "V1Service")
    assert dep.spec.replicas == 2 and dep.spec.template.spec.containers[0].image == "reg.example/llmc:1"
    assert dep.spec.selector.match_labels == dep.spec.template.metadata.labels == svc.spec.selector
    assert svc.spec.ports[0].target_port == 8000


def test_the_sdk_check_refuses_bad_manifests() -> None:
    """The check above can fail: a missing required field, a misspelled key and a wrong type are refused."""
    with pytest.raises(ValueError, match="name"):
        _deserialize({"image": "x"}, "V1Container")
    with pytest.raises(AssertionError, match="no field"):
        _deserialize({"name": "x", "imagee": "x"}, "V1Container")
    with pytest.raises(AssertionError, match="int"):
        _deserialize({"name": "x", "ports": [{"containerPort": "80"}]}, "V1Container")


def test_ray_serve_config(deploy_engine_dir: Path, tmp_path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    from llmc.deploy.ray_settings import RayAppConfig

    out = _packaged(deploy_engine_dir, tmp_path / "r", "ray", "--replicas", "2", "--max-replicas", "3",
                    "--threads", "1", "--port", "8123")
    raw = yaml.safe_load((out / "config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(raw)
    (app_schema,) = schema.applications
    assert app_schema.import_path == "llmc.deploy.ray_app:build_app" and app_schema.route_prefix == "/"
    assert schema.http_options.port == 8123
    cfg = RayAppConfig.from_args(app_schema.args)
    assert cfg.engine_dir == str(deploy_engine_dir.resolve())
    assert cfg.runtime().kv_prefault  # a replica serves: its KV budget mapped when it starts, as `llmc serve`'s
    assert cfg.autoscaling_config() == {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2,
                                        "target_ongoing_requests": 4.0}


def test_ray_args_errors() -> None:
    from llmc.deploy.ray_settings import RayAppConfig
    from llmc.errors import InputError

    with pytest.raises(InputError, match="unknown llmc Ray Serve arg 'replica'"):
        RayAppConfig.from_args({"engine_dir": "x", "replica": 2})
    with pytest.raises(InputError, match=r"--max-replicas \(1\) must be >= max\(1, --min-replicas \(2\)\)"):
        RayAppConfig(engine_dir="x", min_replicas=2, max_replicas=1)
    with pytest.raises(InputError, match="--max-step-tokens"):
        RayAppConfig(engine_dir="x", max_running=8, max_step_tokens=4)
    for value in (float("nan"), float("inf"), 0.0):  # nan passed the `<= 0` check
        with pytest.raises(InputError, match=f"--target-ongoing-requests must be a finite number > 0, got {value}"):
            RayAppConfig(engine_dir="x", target_ongoing_requests=value)


@pytest.mark.parametrize(("args", "needle"), [
    # were TypeError tracebacks comparing a string (or None) with a number
    ({"replicas": "2"}, "arg 'replicas' must be an integer, got '2'"),
    ({"threads": None}, "arg 'threads' must be an integer, got None"),
    ({"target_ongoing_requests": "4"}, "arg 'target_ongoing_requests' must be a number, got '4'"),
    ({"min_replicas": "1"}, "arg 'min_replicas' must be an integer or null, got '1'"),
    # were accepted: fractional replica counts and queue sizes, a bool as a count, a NaN KV budget
    ({"replicas": 2.5}, "arg 'replicas' must be an integer, got 2.5"),
    ({"max_replicas": 1.5}, "arg 'max_replicas' must be an integer or null, got 1.5"),
    ({"max_queue": 2.5}, "arg 'max_queue' must be an integer, got 2.5"),
    ({"replicas": True}, "arg 'replicas' must be an integer, got True"),
    ({"kv_budget_mb": float("nan")}, "arg 'kv_budget_mb' must be an integer, got nan"),
    ({"model_name": 5}, "arg 'model_name' must be a string or null, got 5"),
    # were accepted: an empty name fell back to the folder's; an empty API key meant no authentication at all
    ({"model_name": ""}, "--served-model-name must not be empty"),
    ({"engine_dir": ""}, "engine_dir must not be empty"),
    ({"api_key": ""}, "--api-key (or LLMC_API_KEY) must be printable ASCII and not empty"),
    ({"api_key": "clé"}, "--api-key (or LLMC_API_KEY) must be printable ASCII and not empty"),
])
def test_ray_args_of_the_wrong_type_are_one_line_errors(args: dict[str, Any], needle: str) -> None:
    from llmc.deploy.ray_settings import RayAppConfig
    from llmc.errors import InputError

    with pytest.raises(InputError) as e:
        RayAppConfig.from_args({"engine_dir": "x", **args})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_ray_args_must_be_a_mapping() -> None:
    from llmc.deploy.ray_settings import RayAppConfig
    from llmc.errors import InputError

    for args in (None, ["engine_dir"]):  # were TypeErrors
        with pytest.raises(InputError, match="args must be a mapping of settings"):
            RayAppConfig.from_args(args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("flags", "needles"), [
    (("--port", "0"), ("--port", "[1, 65535]", "0")),
    (("--name", "Not_A_Label"), ("--name", "DNS label")),
    (("--replicas", "3", "--max-replicas", "2"), ("--max-replicas (2)", "--replicas (3)")),
    (("--kv-budget-mb", "0"), ("--kv-budget-mb", ">= 1")),
    # accepted, the packaged server then refused to start (its engine steps hold 512 tokens)
    (("--max-running", "600"), ("--max-running must be <= 512", "600")),
    # accepted: '' silently meant the default image, the others were written into the manifests as they came
    (("--image", ""), ("--image ''", "container image reference")),
    (("--image", "my image:1"), ("--image 'my image:1'", "container image reference")),
    (("--image", "Reg/LLMC:1"), ("--image 'Reg/LLMC:1'", "container image reference")),
    # accepted: Kubernetes refuses a Service whose name starts with a digit (DNS-1035)
    (("--name", "8bit"), ("--name '8bit'", "start with a letter")),
])
def test_bad_flags_are_one_line_errors(deploy_engine_dir: Path, tmp_path: Path, flags: tuple[str, ...],
                                       needles: tuple[str, ...]) -> None:
    _error(_cli(deploy_engine_dir, "--target", "kserve", "-o", tmp_path / "o", *flags), *needles)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("target", "flags", "needle"), [
    # were dropped without a word: the package did not do what the command line said
    ("triton", ("--image", "reg/llmc:1"), "--image is for --target docker or kserve; --target triton does not use it"),
    ("kserve", ("--mount-engine",), "--mount-engine is for --target docker; --target kserve does not use it"),
    ("docker", ("--replicas", "3"), "--replicas is for --target kserve or ray; --target docker does not use it"),
    ("triton", ("--max-replicas", "4"), "--max-replicas is for --target kserve or ray; --target triton does not"),
])
def test_options_of_other_targets_are_refused(deploy_engine_dir: Path, tmp_path: Path, target: str,
                                              flags: tuple[str, ...], needle: str) -> None:
    _error(_cli(deploy_engine_dir, "--target", target, "-o", tmp_path / "o", *flags), needle)
    assert not (tmp_path / "o").exists()


def test_bad_paths_are_one_line_errors(deploy_engine_dir: Path, tmp_path: Path) -> None:
    _error(_cli(tmp_path / "nope", "--target", "docker", "-o", tmp_path / "o"), "nope", "does not exist")
    (tmp_path / "notengine").mkdir()
    _error(_cli(tmp_path / "notengine", "--target", "docker", "-o", tmp_path / "o"), "not an engine folder")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    _error(_cli(deploy_engine_dir, "--target", "ray", "-o", tmp_path / "full"), "not empty", "--force")
    assert (tmp_path / "full" / "x").read_text() == "keep"
    _error(_cli(deploy_engine_dir, "--target", "ray", "-o", deploy_engine_dir / "sub", "--force"), "overlaps")


def test_bad_engines_and_outputs_are_one_line_errors(deploy_engine_dir: Path, tmp_path: Path) -> None:
    """Were: 'does not exist' for a file, a package of an engine folder without its weights (the image failed when
    it started), and tracebacks for an output folder that cannot be made."""
    _error(_cli(deploy_engine_dir / "engine.json", "--target", "ray", "-o", tmp_path / "o"), "engine.json is a file")
    hollow = tmp_path / "hollow"
    hollow.mkdir()
    (hollow / "engine.json").write_text((deploy_engine_dir / "engine.json").read_text())
    _error(_cli(hollow, "--target", "kserve", "-o", tmp_path / "o"), "hollow lacks", "rebuild it")
    (tmp_path / "file").write_text("x")
    _error(_cli(deploy_engine_dir, "--target", "ray", "-o", tmp_path / "file" / "o"), "cannot be made",
           "file is a file")
    _error(_cli(deploy_engine_dir, "--target", "ray", "-o", "/proc/llmc-package"), "cannot be made",
           "/proc/llmc-package")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("target", "written"), [("ray", "config.yaml"), ("kserve", "deployment.yaml")])
def test_a_model_name_with_line_breaks_stays_in_its_comment(deploy_engine_dir: Path, tmp_path: Path, target: str,
                                                            written: str) -> None:
    """The manifest's model name was written into the files' header comments as it was: a line break in it ended
    the comment, and what followed became YAML (or Dockerfile, or config.pbtxt) of its own."""
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(deploy_engine_dir, engine)
    manifest = json.loads((engine / "engine.json").read_text())
    manifest["model_name"] = "evil\nhttp_options: {port: 1}\r\nkind: Pod"
    (engine / "engine.json").write_text(json.dumps(manifest))
    out = _packaged(engine, tmp_path / "o", target)
    text = (out / written).read_text()
    assert "# evil http_options: {port: 1} kind: Pod" in text
    docs = list(yaml.safe_load_all(text))
    assert all(d.get("kind") != "Pod" for d in docs) and docs[0].get("http_options", {}).get("port") != 1
