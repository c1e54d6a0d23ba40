"""deploy/kubernetes/, rendered by `kubectl kustomize` and checked against the Kubernetes
schemas (kubernetes-validate bundles them: no cluster needed) and against the code: every
TOLLGATE_* variable a manifest sets is one its process reads."""

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.code_facts import ROOT, variables_named, variables_read

KUBERNETES = ROOT / "deploy" / "kubernetes"
# The oldest release these manifests target (native gRPC probes are GA since 1.27).
KUBERNETES_VERSION = "1.32"
SERVICES = ("admission", "scheduler", "worker", "ledger")
TOKENS = ("TOLLGATE_ADMIN_TOKEN", "TOLLGATE_INTERNAL_TOKEN")

Manifest = dict[str, Any]


def render(directory: Path) -> list[Manifest]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: nothing can render the kustomizations")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=["base", "production", "vllm"])
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "base":
        return render(KUBERNETES / "base")
    # production/secrets.env is the operator's, never committed: render with made-up values.
    copy = tmp_path_factory.mktemp("kubernetes") / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    example = (copy / "production" / "secrets.env.example").read_text()
    filled = example.replace("TOLLGATE_ADMIN_TOKEN=", "TOLLGATE_ADMIN_TOKEN=test-admin")
    filled = filled.replace("TOLLGATE_INTERNAL_TOKEN=", "TOLLGATE_INTERNAL_TOKEN=test-internal")
    (copy / "production" / "secrets.env").write_text(filled)
    return render(copy / request.param)


def of_kind(manifests: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def pod_spec(workload: Manifest) -> Manifest:
    return workload["spec"]["template"]["spec"]


def containers(workload: Manifest) -> Iterator[Manifest]:
    spec = pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def service_of(container: Manifest) -> str | None:
    command = container.get("command", [])
    if command[:2] == ["python", "-m"] and command[2].startswith("services."):
        return str(command[2].removeprefix("services."))
    return None


def variables_set(container: Manifest, manifests: list[Manifest]) -> set[str]:
    """Every variable the container gets: its env, and the keys of what it takes envFrom."""
    names = {item["name"] for item in container.get("env", [])}
    sources = {**of_kind(manifests, "ConfigMap"), **of_kind(manifests, "Secret")}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source["secretRef"]
        source_object = sources[ref["name"]]
        names |= set(source_object.get("data", {})) | set(source_object.get("stringData", {}))
    return names


def env_value(container: Manifest, name: str, manifests: list[Manifest]) -> str:
    for item in container.get("env", []):
        if item["name"] == name:
            return str(item["value"])
    for source in container.get("envFrom", []):
        config = of_kind(manifests, "ConfigMap").get(source.get("configMapRef", {}).get("name"))
        if config and name in config["data"]:
            return str(config["data"][name])
    raise KeyError(name)


def deployment(manifests: list[Manifest], service: str) -> Manifest:
    return of_kind(manifests, "Deployment")[f"tollgate-{service}"]


def main_container(manifests: list[Manifest], service: str) -> Manifest:
    return pod_spec(deployment(manifests, service))["containers"][0]


def test_every_object_matches_the_kubernetes_schema(rendered: list[Manifest]) -> None:
    for manifest in rendered:
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"{name}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            pytest.fail(f"{name}: {error.message}")


def test_the_objects(rendered: list[Manifest], request: pytest.FixtureRequest) -> None:
    # The vllm overlay adds the engine server the workers drive.
    engine = {"tollgate-vllm"} if request.node.callspec.params["rendered"] == "vllm" else set()
    assert set(of_kind(rendered, "Deployment")) == {f"tollgate-{s}" for s in SERVICES} | engine
    assert {"tollgate-migrate", "tollgate-topics"} <= set(of_kind(rendered, "Job"))
    assert set(of_kind(rendered, "Service")) == {
        "tollgate-admission", "tollgate-scheduler", "tollgate-ledger",
    } | engine  # fmt: skip
    if engine:
        worker = {e["name"]: e.get("value") for e in main_container(rendered, "worker")["env"]}
        assert worker["TOLLGATE_ENGINE_KIND"] == "vllm"
        assert worker["TOLLGATE_ENGINE_URL"] == "http://tollgate-vllm:8000"
    for service in SERVICES:
        assert service_of(main_container(rendered, service)) == service
        assert (ROOT / "services" / service / "__main__.py").exists()
    [hpa] = of_kind(rendered, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "tollgate-worker",
    }  # fmt: skip
    # The autoscaler owns the worker count: a replicas field would fight it on every apply.
    assert "replicas" not in deployment(rendered, "worker")["spec"]
    assert of_kind(rendered, "PodDisruptionBudget")


def test_every_variable_set_is_one_the_process_reads(rendered: list[Manifest]) -> None:
    unread: dict[str, set[str]] = {}
    for service in SERVICES:
        names = variables_set(main_container(rendered, service), rendered)
        extra = {n for n in names if n.startswith("TOLLGATE_")} - variables_read(service)
        if extra:
            unread[service] = extra
    assert not unread, f"variables no code of the process reads: {unread}"


def test_the_jobs_get_what_their_commands_read(rendered: list[Manifest]) -> None:
    for name, job in of_kind(rendered, "Job").items():
        for container in containers(job):
            named = variables_named(" ".join(container["command"]))
            given = {n for n in variables_set(container, rendered) if n.startswith("TOLLGATE_")}
            assert given == named, (name, container["name"])


def test_references_resolve(rendered: list[Manifest]) -> None:
    config_maps, secrets = of_kind(rendered, "ConfigMap"), of_kind(rendered, "Secret")
    claims = of_kind(rendered, "PersistentVolumeClaim")
    for workload in [*of_kind(rendered, "Deployment").values(), *of_kind(rendered, "Job").values()]:
        for container in containers(workload):
            for item in container.get("env", []):
                ref = item.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    key = ref["configMapKeyRef"]
                    assert key["key"] in config_maps[key["name"]]["data"], item
                if "secretKeyRef" in ref:
                    key = ref["secretKeyRef"]
                    assert key["key"] in secrets[key["name"]]["data"], item
            mounts = {mount["name"] for mount in container.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in pod_spec(workload).get("volumes", [])}
        for volume in pod_spec(workload).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims


def test_selectors_match_their_pods(rendered: list[Manifest]) -> None:
    deployments = of_kind(rendered, "Deployment").values()

    def selected(selector: dict[str, str]) -> list[Manifest]:
        return [
            d
            for d in deployments
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]

    for name, service in of_kind(rendered, "Service").items():
        [target] = selected(service["spec"]["selector"])
        port_names = {p["name"] for c in containers(target) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (name, port)
    for name, budget in of_kind(rendered, "PodDisruptionBudget").items():
        assert len(selected(budget["spec"]["selector"]["matchLabels"])) == 1, name
    for d in deployments:
        assert d["spec"]["selector"]["matchLabels"].items() <= (
            d["spec"]["template"]["metadata"]["labels"].items()
        )


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_probes_and_metrics_use_the_ports_the_processes_listen_on(
    rendered: list[Manifest],
) -> None:
    for service in SERVICES:
        container = main_container(rendered, service)
        listen = env_value(container, "TOLLGATE_LISTEN", rendered)
        assert listen.startswith("0.0.0.0:"), service
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == port_of(listen)
        # grpc.health.v1, served by every process on its gRPC port (services/core/server.py).
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": port_of(listen)}, (service, probe)
        metrics = env_value(container, "TOLLGATE_METRICS_LISTEN", rendered)
        assert metrics.startswith("0.0.0.0:")
        assert ports["metrics"] == port_of(metrics)
        annotations = deployment(rendered, service)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port_of(metrics))


def test_the_services_find_each_other(rendered: list[Manifest]) -> None:
    scheduler = of_kind(rendered, "Service")["tollgate-scheduler"]
    [port] = scheduler["spec"]["ports"]
    for service in ("admission", "worker"):
        address = env_value(
            main_container(rendered, service), "TOLLGATE_SCHEDULER_ADDRESS", rendered
        )
        assert address == f"tollgate-scheduler:{port['port']}"
    worker = main_container(rendered, "worker")
    # The scheduler dials each worker at its own pod IP; every pod names itself.
    assert env_value(worker, "TOLLGATE_WORKER_ADVERTISE", rendered) == (
        f"$(POD_IP):{port_of(env_value(worker, 'TOLLGATE_LISTEN', rendered))}"
    )
    assert "TOLLGATE_WORKER_ID" not in variables_set(worker, rendered)
    models = {
        env_value(main_container(rendered, s), "TOLLGATE_MODELS", rendered)
        for s in ("admission", "worker")
    }
    assert len(models) == 1


def test_the_tokens_come_from_the_secret(rendered: list[Manifest]) -> None:
    [secret] = of_kind(rendered, "Secret").values()
    assert set(TOKENS) <= set(secret["data"])
    for service in SERVICES:
        for item in main_container(rendered, service).get("env", []):
            if item["name"] in (*TOKENS, "TOLLGATE_DATABASE_URL"):
                assert item["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    for config in of_kind(rendered, "ConfigMap").values():
        assert not set(config["data"]) & {*TOKENS, "TOLLGATE_DATABASE_URL"}
        assert all(key.startswith("TOLLGATE_") for key in config["data"])


def test_no_real_secret_is_committed() -> None:
    base = dict(
        line.split("=", 1)
        for line in (KUBERNETES / "base" / "secrets.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert set(TOKENS) <= set(base)
    assert all("placeholder" in value for value in base.values()), base
    example = (KUBERNETES / "production" / "secrets.env.example").read_text()
    for token in TOKENS:
        assert f"\n{token}=\n" in example
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/kubernetes/production/secrets.env"], cwd=ROOT
    )
    assert ignored.returncode == 0, "production/secrets.env must be ignored by git"
