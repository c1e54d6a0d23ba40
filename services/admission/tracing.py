"""The root span of a run's trace: the request as admission received it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.trace import Span, SpanKind

from services.admission.requests import GenerateParams
from services.core.telemetry import get_tracer


@contextmanager
def generate_span(tenant_id: str, params: GenerateParams) -> Iterator[Span]:
    """A server span named as the GenAI conventions name one (`{operation} {model}`)."""
    operation = "chat" if params.messages else "text_completion"
    sampling = params.sampling
    attributes: dict[str, str | int | float] = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": params.model,
        "gen_ai.request.max_tokens": sampling.max_tokens,
        "tollgate.tenant_id": tenant_id,
        "tollgate.priority": str(params.priority),
    }
    for name, value in (
        ("gen_ai.request.temperature", sampling.temperature),
        ("gen_ai.request.top_p", sampling.top_p),
        ("gen_ai.request.top_k", sampling.top_k),
    ):
        if value is not None:
            attributes[name] = value
    with get_tracer().start_as_current_span(
        f"{operation} {params.model}", kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span
