"""`--target kserve`: a KServe `InferenceService` (a custom predictor container running `llmc serve`) and a plain
Kubernetes Deployment + Service alternative, both made with their SDKs' models (which check required fields and
types) and written as YAML. The container is the `--target docker` image (`--image`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from llmc.deploy.docker import serve_args
from llmc.deploy.package import EngineFacts, PackageConfig
from llmc.errors import BackendUnavailableError


def _sdk() -> tuple[Any, Any]:
    try:
        import kserve
        from kubernetes import client
    except ImportError as e:
        raise BackendUnavailableError(f"--target kserve needs the kserve SDK ({e.name} is missing): "
                                      "pip install 'llmc[kserve]'") from None
    return kserve, client


def write(config: PackageConfig, facts: EngineFacts, work: Path) -> list[str]:
    import yaml

    kserve, k8s = _sdk()
    api = k8s.ApiClient()
    isvc = kserve.ApiClient().sanitize_for_serialization(inference_service(config, facts))  # camelCase keys
    (work / "inferenceservice.yaml").write_text(_header(config, facts) + yaml.safe_dump(isvc, sort_keys=False))
    docs = [api.sanitize_for_serialization(o) for o in (deployment(config, facts), service(config))]
    (work / "deployment.yaml").write_text(_header(config, facts) + yaml.safe_dump_all(docs, sort_keys=False))
    return ["inferenceservice.yaml", "deployment.yaml"]


def _header(config: PackageConfig, facts: EngineFacts) -> str:
    return (f"# {facts.model_name} served by `llmc serve` from {config.image_ref} (build it with "
            "`llmc package --target docker`); written by `llmc package --target kserve`.\n"
            "# kubectl apply -f this file\n")


def resources(config: PackageConfig, facts: EngineFacts) -> Any:
    """Requests from the engine's memory needs (weights + KV budget + runtime); the limit leaves 25% headroom."""
    _, k8s = _sdk()
    mem = facts.memory_mb(config.kv_budget_mb)
    cpu = str(config.threads or 2)
    return k8s.V1ResourceRequirements(requests={"cpu": cpu, "memory": f"{mem}Mi"},
                                      limits={"cpu": cpu, "memory": f"{math.ceil(mem * 1.25)}Mi"})


def container(config: PackageConfig, facts: EngineFacts, name: str) -> Any:
    _, k8s = _sdk()

    def probe(delay: int, period: int, failures: int) -> Any:
        return k8s.V1Probe(http_get=k8s.V1HTTPGetAction(path="/health", port=config.port),
                           initial_delay_seconds=delay, period_seconds=period, timeout_seconds=5,
                           failure_threshold=failures)

    args = serve_args(config)
    return k8s.V1Container(
        name=name, image=config.image_ref, command=args[:1], args=args[1:],
        ports=[k8s.V1ContainerPort(container_port=config.port, name="http1", protocol="TCP")],
        resources=resources(config, facts),
        readiness_probe=probe(5, 5, 3),
        liveness_probe=probe(60, 15, 4),  # the engine loads before it answers: no restart while it does
        security_context=k8s.V1SecurityContext(run_as_non_root=True, run_as_user=10001,
                                               allow_privilege_escalation=False))


def inference_service(config: PackageConfig, facts: EngineFacts) -> Any:
    kserve, k8s = _sdk()
    predictor = kserve.V1beta1PredictorSpec(
        containers=[container(config, facts, "kserve-container")], min_replicas=config.replicas,
        max_replicas=config.max_replicas or config.replicas,
        termination_grace_period_seconds=45)  # llmc serve drains for 30 s on SIGTERM
    return kserve.V1beta1InferenceService(
        api_version=kserve.constants.KSERVE_V1BETA1, kind="InferenceService",
        metadata=k8s.V1ObjectMeta(name=config.served_name, labels=_labels(config)),
        spec=kserve.V1beta1InferenceServiceSpec(predictor=predictor))


def deployment(config: PackageConfig, facts: EngineFacts) -> Any:
    _, k8s = _sdk()
    pod = k8s.V1PodSpec(containers=[container(config, facts, "llmc")], termination_grace_period_seconds=45)
    return k8s.V1Deployment(
        api_version="apps/v1", kind="Deployment",
        metadata=k8s.V1ObjectMeta(name=config.served_name, labels=_labels(config)),
        spec=k8s.V1DeploymentSpec(
            replicas=config.replicas, selector=k8s.V1LabelSelector(match_labels=_labels(config)),
            template=k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=_labels(config)), spec=pod)))


def service(config: PackageConfig) -> Any:
    _, k8s = _sdk()
    return k8s.V1Service(
        api_version="v1", kind="Service", metadata=k8s.V1ObjectMeta(name=config.served_name, labels=_labels(config)),
        spec=k8s.V1ServiceSpec(selector=_labels(config), ports=[
            k8s.V1ServicePort(name="http", port=80, target_port=config.port, protocol="TCP")]))


def _labels(config: PackageConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": config.served_name, "app.kubernetes.io/part-of": "llmc"}
