"""Which exporters and metrics settings the OTEL_* and TOLLGATE_METRICS_* variables ask for."""

from __future__ import annotations

import pytest

from services.core.config import ConfigError, MetricsSettings
from services.core.metrics import OTHER_TENANT, TenantLabels
from services.core.telemetry import service_resource, traces_exporters

_OTEL = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _OTEL:
        monkeypatch.delenv(name, raising=False)
    for name in ("LISTEN", "PORT", "TENANTS", "TOP_TENANTS"):
        monkeypatch.delenv(f"TOLLGATE_METRICS_{name}", raising=False)


def test_no_exporter_without_an_endpoint() -> None:
    assert traces_exporters() == []


def test_otlp_by_default_once_an_endpoint_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert traces_exporters() == ["otlp"]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert traces_exporters() == []


def test_console_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert traces_exporters() == ["console"]
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER"):
        traces_exporters()


def test_service_name_is_tollgate_process_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert service_resource("worker").attributes["service.name"] == "tollgate-worker"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gpu-pool-a")
    assert service_resource("worker").attributes["service.name"] == "gpu-pool-a"


def test_metrics_listen_is_host_and_port(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MetricsSettings.from_env().listen == ""
    monkeypatch.setenv("TOLLGATE_METRICS_LISTEN", "0.0.0.0:9464")
    assert MetricsSettings.from_env().listen == "0.0.0.0:9464"
    for bad in ("9464", "host:", "host:port", ":9464", "host:70000"):
        monkeypatch.setenv("TOLLGATE_METRICS_LISTEN", bad)
        with pytest.raises(ConfigError, match="TOLLGATE_METRICS_LISTEN"):
            MetricsSettings.from_env()


def test_the_old_port_variable_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_METRICS_PORT", "9464")
    with pytest.raises(ConfigError, match="TOLLGATE_METRICS_LISTEN"):
        MetricsSettings.from_env()


def test_tenant_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_METRICS_TENANTS", "ten_a, ten_b,")
    settings = MetricsSettings.from_env()
    assert settings.tenants == {"ten_a", "ten_b"}
    labels = TenantLabels(settings.tenants)
    assert [labels.of(t) for t in ("ten_a", "ten_b", "ten_c")] == ["ten_a", "ten_b", OTHER_TENANT]
    monkeypatch.setenv("TOLLGATE_METRICS_TOP_TENANTS", "-1")
    with pytest.raises(ConfigError, match="TOLLGATE_METRICS_TOP_TENANTS"):
        MetricsSettings.from_env()
