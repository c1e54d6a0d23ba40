"""docker-compose.yml's Prometheus and Grafana, its replicas and its variables, checked
against deploy/ and the code (no container engine runs here)."""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_spec import PyOptions

from tests.deploy.code_facts import ROOT, metrics_defined, variables_read
from tools import dashboard

SERVICES = ("admission", "scheduler", "worker", "ledger")
SCALABLE = ("admission", "worker", "ledger")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    parsed = PyOptions(apply_merge=True).from_yaml((ROOT / "docker-compose.yml").read_text())
    parsed.validate()
    return dict(parsed.to_dict()["services"])


def env(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def mounted(service: dict[str, Any], target: str) -> Path:
    """The host path of `service`'s bind mount at `target`."""
    for volume in service["volumes"]:
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == target:
            return ROOT / source
    raise KeyError(target)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_prometheus_scrapes_every_replica_of_every_service(services: dict[str, Any]) -> None:
    config = yaml.safe_load(
        mounted(services["prometheus"], "/etc/prometheus/prometheus.yml").read_text()
    )
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for name in SERVICES:
        listen = env(services[name])["TOLLGATE_METRICS_LISTEN"]
        assert listen.startswith("0.0.0.0:"), name  # reachable from the prometheus container
        # DNS service discovery: the compose name resolves to every replica's address.
        [discovery] = jobs[name]["dns_sd_configs"]
        assert discovery == {**discovery, "names": [name], "type": "A", "port": port_of(listen)}


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(
    services: dict[str, Any],
) -> None:
    grafana = services["grafana"]
    provisioning = mounted(grafana, "/etc/grafana/provisioning")
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090"
    assert any(str(p).endswith(":9090:9090") for p in services["prometheus"]["ports"])
    [provider] = yaml.safe_load((provisioning / "dashboards" / "tollgate.yml").read_text())[
        "providers"
    ]
    dashboards = mounted(grafana, provider["options"]["path"])
    board = json.loads((dashboards / "tollgate.json").read_text())
    assert env(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == (
        f"{provider['options']['path']}/tollgate.json"
    )
    uids = {
        target["datasource"]["uid"]
        for panel in board["panels"]
        for target in panel.get("targets", [])
    }
    assert uids == {source["uid"]}
    assert env(grafana)["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")


def test_the_dashboard_is_what_tools_dashboard_makes() -> None:
    assert dashboard.OUTPUT.read_text() == dashboard.render(), "stale: run `make dashboard`"


def test_the_dashboard_shows_what_an_operator_asks_for() -> None:
    titles = {p["title"] for p in dashboard.dashboard()["panels"]}
    for wanted in ("Time to first token", "Inter-token latency", "Queue time", "Spend per hour"):
        assert wanted in titles
    assert {"KV cache usage per worker", "Tokens per second", "Relay lag", "Consumer lag"} <= titles


def test_the_dashboard_queries_only_series_the_code_serves() -> None:
    defined = metrics_defined()
    for role, names in dashboard.METRICS.items():
        for name in (name.partition("{")[0] for name in names):
            assert name in defined or f"{name}_bucket" in defined, (role, name)


def test_scalable_services_have_no_fixed_name_or_host_port(services: dict[str, Any]) -> None:
    for name in SCALABLE:
        service = services[name]
        assert "container_name" not in service, name
        for port in service.get("ports", []):
            low, _, high = str(port["published"]).partition("-")
            assert high and int(high) > int(low), (name, port)
    assert not [name for name, s in services.items() if "container_name" in s]


def test_every_variable_set_is_one_the_process_reads(services: dict[str, Any]) -> None:
    unread = {
        name: extra
        for name in SERVICES
        if (extra := {v for v in env(services[name]) if v.startswith("TOLLGATE_")}
            - variables_read(name))
    }  # fmt: skip
    assert not unread, f"variables no code of the process reads: {unread}"
