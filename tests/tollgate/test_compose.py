"""docker-compose.yml, checked by the compose-spec parser and for how the services are wired.

No container engine runs here: this is what can be known without one.
"""

import re
import shlex
from graphlib import TopologicalSorter
from pathlib import Path
from typing import Any

import pytest
from compose_spec import PyCompose, PyOptions

from tollgate.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
TOLLGATE_SERVICES = ("admission", "scheduler", "worker", "ledger")
ONE_SHOTS = ("migrate", "topics", "model", "model-vllm")
MONITORING = ("prometheus", "grafana")
# The `gpu` profile: vLLM, a worker driving it, and an admission that serves its model.
GPU = ("vllm", "worker-vllm", "admission-vllm")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    # apply_merge: the file shares settings through YAML anchors and `<<` merge keys.
    parsed = PyOptions(apply_merge=True).from_yaml((ROOT / "docker-compose.yml").read_text())
    parsed.validate()
    return parsed.to_dict()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def env(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def command(service: dict[str, Any]) -> list[str]:
    value = service["command"]
    return shlex.split(value) if isinstance(value, str) else list(value)


def test_the_spec_parser_rejects_what_compose_would() -> None:
    with pytest.raises(ValueError):
        PyCompose.from_yaml(
            "services:\n  a:\n    image: x\n    depends_on:\n      b:\n        condition: soon\n"
        )


def test_the_services(services: dict[str, Any]) -> None:
    assert set(services) == {
        "postgres", "kafka", *ONE_SHOTS, *TOLLGATE_SERVICES, *MONITORING, *GPU
    }  # fmt: skip
    for name in GPU:
        assert services[name]["profiles"] == ["gpu"], name
    worker = env(services["worker-vllm"])
    assert worker["TOLLGATE_ENGINE_KIND"] == "vllm"
    assert worker["TOLLGATE_ENGINE_URL"] == "http://vllm:8000"
    assert services["postgres"]["image"] == "postgres:17"
    assert services["kafka"]["image"].startswith("apache/kafka:")
    for name in (*ONE_SHOTS, *TOLLGATE_SERVICES):
        assert services[name]["image"] == "tollgate:local"
        assert services[name]["build"]["context"] == "."
    for name in TOLLGATE_SERVICES:
        assert command(services[name]) == ["python", "-m", f"services.{name}"]


def test_each_service_module_exists() -> None:
    missing = [n for n in TOLLGATE_SERVICES if not (ROOT / "services" / n / "__main__.py").exists()]
    assert not missing, f"docker-compose.yml runs services that do not exist: {missing}"


def test_dependencies_exist_are_acyclic_and_wait_properly(services: dict[str, Any]) -> None:
    graph = {name: set(s.get("depends_on", {})) for name, s in services.items()}
    for name, targets in graph.items():
        assert targets <= set(services), name
    list(TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    for name, service in services.items():
        for target, rule in service.get("depends_on", {}).items():
            if rule["condition"] == "service_healthy":
                assert "healthcheck" in services[target], (name, target)
            if rule["condition"] == "service_completed_successfully":
                assert target in ONE_SHOTS and services[target]["restart"] == "no"
    for name in TOLLGATE_SERVICES:
        depends = services[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"
        assert depends["topics"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["model"]["condition"] == (
        "service_completed_successfully"
    )


def test_the_services_find_each_other(services: dict[str, Any]) -> None:
    listen = {name: env(services[name])["TOLLGATE_LISTEN"] for name in TOLLGATE_SERVICES}
    for name, address in listen.items():
        assert address.startswith("0.0.0.0:"), name
        assert services[name]["healthcheck"]["test"] == [
            "CMD", "tollgate", "health", f"127.0.0.1:{port_of(address)}",
        ]  # fmt: skip
    for name in (*TOLLGATE_SERVICES, "migrate", "topics"):
        variables = env(services[name])
        assert re.match(
            r"postgresql\+psycopg://\w+:.+@postgres:5432/\w+$", variables["TOLLGATE_DATABASE_URL"]
        )
        assert variables["TOLLGATE_KAFKA_BOOTSTRAP"] == "kafka:9092"
    for name in TOLLGATE_SERVICES:  # required, no default: compose refuses to start without it
        assert env(services[name])["TOLLGATE_INTERNAL_TOKEN"].startswith(
            "${TOLLGATE_INTERNAL_TOKEN:?"
        )
    kafka = env(services["kafka"])
    assert "PLAINTEXT://kafka:9092" in kafka["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller"
    for name in ("admission", "worker"):
        assert env(services[name])["TOLLGATE_SCHEDULER_ADDRESS"] == (
            f"scheduler:{port_of(listen['scheduler'])}"
        )
    gateway_port = port_of(listen["admission"])
    [gateway] = [p for p in services["admission"]["ports"] if p["target"] == gateway_port]
    assert str(gateway["published"]).startswith(f"{gateway_port}-")


# `docker compose up --scale worker=3 --scale admission=2 --scale ledger=2`
SCALED = ("worker", "admission", "ledger")


def test_scaled_services_can_run_as_replicas(services: dict[str, Any]) -> None:
    for name in SCALED:
        service = services[name]
        assert "container_name" not in service, name
        for port in service.get("ports", []):
            # A fixed host port would be taken by the first replica: only ranges, or none.
            published = str(port["published"]) if isinstance(port, dict) else ""
            low, _, high = published.partition("-")
            assert high and int(high) - int(low) >= 1, (name, port)
    worker = env(services["worker"])
    # Each worker names itself, and registers: no fixed id, no list of workers.
    assert "TOLLGATE_WORKER_ID" not in worker
    assert "TOLLGATE_WORKERS" not in env(services["scheduler"])
    assert worker["TOLLGATE_LISTEN"].startswith("0.0.0.0:")
    assert "TOLLGATE_WORKER_ADVERTISE" not in worker  # its container's own address


def test_the_model_volume(compose: dict[str, Any], services: dict[str, Any]) -> None:
    assert "models" in compose["volumes"]
    assert "tollgate models init-tiny /models/tiny" in " ".join(command(services["model"]))
    assert "models:/models" in services["model"]["volumes"]
    for name in ("admission", "worker"):
        assert env(services[name])["TOLLGATE_MODELS"] == "tiny=/models/tiny"
        assert "models:/models:ro" in services[name]["volumes"]
    parsed = build_parser().parse_args(["models", "init-tiny", "/models/tiny"])
    assert parsed.func is not None


def test_the_admin_token_is_required_and_never_committed(services: dict[str, Any]) -> None:
    for name in ("admission", "ledger"):
        token = env(services[name])["TOLLGATE_ADMIN_TOKEN"]
        assert re.fullmatch(r"\$\{TOLLGATE_ADMIN_TOKEN:\?[^}]*\}", token), token
    for name, service in services.items():
        if name not in ("admission", "ledger"):
            assert "TOLLGATE_ADMIN_TOKEN" not in env(service), name


def test_the_one_shot_commands_name_real_functions(services: dict[str, Any]) -> None:
    from services.core.kafka import ensure_topics
    from services.core.migrate import upgrade

    assert callable(upgrade) and callable(ensure_topics)
    for name in ("migrate", "topics"):
        argv = command(services[name])
        assert argv[:2] == ["python", "-c"]
        compile(argv[2], f"<{name}>", "exec")
    assert "upgrade(" in command(services["migrate"])[2]
    assert "ensure_topics(" in command(services["topics"])[2]


def test_the_dockerfile_and_its_ignore_file() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.findall(r"^FROM .*$", dockerfile, re.M) == ["FROM python:3.11-slim"]
    assert re.search(
        r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu",
        dockerfile,
    )
    assert "pip install -e ." in dockerfile
    assert "USER tollgate" in dockerfile
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".tollgate"} <= ignored


def published_ports(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host address, host port) of each published port; "" for all interfaces."""
    found = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            found.append((str(port.get("host_ip", "")), str(port["published"])))
        else:
            host, _, rest = str(port).rpartition(":")
            address, _, published = host.rpartition(":")
            found.append((address, published))
    return found


def test_only_the_public_ports_are_published_and_the_broker_on_loopback(
    services: dict[str, Any],
) -> None:
    # The internal services and the database are reached over the compose network only.
    for name in ("scheduler", "worker", "postgres"):
        assert published_ports(services[name]) == [], name
    # Anyone who reaches the broker reads every tenant's prompts and writes the topic.
    assert published_ports(services["kafka"]) == [("127.0.0.1", "29092")]
