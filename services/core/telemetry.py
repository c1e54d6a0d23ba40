"""Logging and tracing setup shared by every process.

Logs are structlog JSON lines on stderr; `run_id`, `tenant_id`, `seq` and
`trace_id` are bound through contextvars wherever they are known.  Traces go
through the OpenTelemetry SDK, exported as the standard OTEL_* variables say (OTLP over
gRPC, or the console); the W3C `traceparent` string is how a run's trace context travels
inside events, AssignRun and Kafka headers, so that one run is one trace across
admission, scheduler, worker and ledger.  Metrics: `services/core/metrics.py`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.core.config import ConfigError

_propagator = TraceContextTextMapPropagator()
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def configure_logging(service: str, level: str | None = None) -> None:
    """JSON logs to stderr with contextvars merged in."""
    level_name = (level or os.environ.get("TOLLGATE_LOG_LEVEL", "INFO")).upper()
    logging.basicConfig(stream=sys.stderr, level=level_name, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_id,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level_name)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def _add_trace_id(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    context = trace.get_current_span().get_span_context()
    if context.is_valid and "trace_id" not in event:
        event["trace_id"] = format(context.trace_id, "032x")
    return event


def service_resource(service: str) -> Resource:
    """`service.name` = tollgate-<process>, unless OTEL_SERVICE_NAME names it otherwise;
    with OTEL_RESOURCE_ATTRIBUTES."""
    name = os.environ.get("OTEL_SERVICE_NAME") or f"tollgate-{service}"
    return Resource.create({"service.name": name})


def traces_exporters() -> list[str]:
    """OTEL_TRACES_EXPORTER's exporters; by default OTLP when an endpoint is set, else none."""
    raw = os.environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if not raw:
        has_endpoint = any(os.environ.get(name) for name in _ENDPOINT_VARIABLES)
        return ["otlp"] if has_endpoint else []
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = sorted(set(names) - {"otlp", "console", "none"})
    if unknown:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER must name otlp, console or none, got {', '.join(unknown)}"
        )
    return [name for name in names if name != "none"]


def _otlp_span_exporter() -> SpanExporter:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    if protocol != "grpc":
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be grpc, got {protocol!r}")
    # Reads OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, _HEADERS, _INSECURE, _TIMEOUT itself.
    return OTLPSpanExporter()


def configure_tracing(service: str) -> None:
    """Installs the SDK tracer provider with the exporters the OTEL_* variables ask for.

    Spans go out in batches from a thread (OTEL_BSP_* tune it), flushed at exit."""
    provider = TracerProvider(resource=service_resource(service))
    for name in traces_exporters():
        if name == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        else:
            provider.add_span_processor(BatchSpanProcessor(_otlp_span_exporter()))
    trace.set_tracer_provider(provider)


def get_tracer() -> trace.Tracer:
    return trace.get_tracer("tollgate")


def current_traceparent() -> str:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", "")


def traceparent_of(span: trace.Span) -> str:
    """The traceparent of `span`, open or not, whatever span is current."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> Context:
    return _propagator.extract({"traceparent": traceparent} if traceparent else {})


@contextmanager
def bound_log_context(**values: Any) -> Iterator[None]:
    """Binds `run_id`, `tenant_id`, `seq` ... to every log line inside the block."""
    with structlog.contextvars.bound_contextvars(**values):
        yield
