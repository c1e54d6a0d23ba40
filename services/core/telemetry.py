"""Logging and tracing setup shared by every process.

Logs are structlog JSON lines on stderr; `run_id`, `tenant_id`, `seq` and
`trace_id` are bound through contextvars wherever they are known.  Traces go
through the OpenTelemetry SDK; the W3C `traceparent` string is how a run's trace
context travels inside events and Kafka headers.  Metrics are Prometheus series,
defined next to what they measure (each service's `metrics.py`, the relay).
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
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()


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


def configure_tracing(service: str) -> None:
    """Installs the SDK tracer provider; TOLLGATE_TRACE_CONSOLE=1 prints spans."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if os.environ.get("TOLLGATE_TRACE_CONSOLE") == "1":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    trace.set_tracer_provider(provider)


def get_tracer() -> trace.Tracer:
    return trace.get_tracer("tollgate")


def current_traceparent() -> str:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> Context:
    return _propagator.extract({"traceparent": traceparent} if traceparent else {})


@contextmanager
def bound_log_context(**values: Any) -> Iterator[None]:
    """Binds `run_id`, `tenant_id`, `seq` ... to every log line inside the block."""
    with structlog.contextvars.bound_contextvars(**values):
        yield
