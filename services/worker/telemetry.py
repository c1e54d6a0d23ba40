"""A run's span on the worker and its metrics: opened at assignment, closed at its end.

The span is a child of the scheduler's dispatch (the AssignRun's traceparent), and the
parent of what follows: its context is the traceparent of every event the worker
appends for the run, which the ledger's billing span continues.
"""

from __future__ import annotations

import time

from opentelemetry.trace import Span, Status, StatusCode

from engine.outputs import RequestOutput
from services.core.telemetry import context_from_traceparent, get_tracer, traceparent_of
from services.worker.metrics import observe_finished
from services.worker.runs import COMPLETED_REASONS, AssignedRun


def start_run_span(
    run_id: str, tenant_id: str, model: str, max_tokens: int, traceparent: str
) -> tuple[Span, str]:
    """The run's open span, and its traceparent for the run's events."""
    span = get_tracer().start_span(
        f"text_completion {model}",
        context=context_from_traceparent(traceparent),
        attributes={
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens,
            "tollgate.run_id": run_id,
            "tollgate.tenant_id": tenant_id,
        },
    )
    return span, traceparent_of(span)


def run_finished(run: AssignedRun, output: RequestOutput) -> None:
    """Records the run's metrics and closes its span with what it produced."""
    duration = time.monotonic() - run.assigned_at
    observe_finished(output, run.model, run.tenant_id, duration, run.num_suspensions)
    span = run.span
    if span is None:
        return
    metrics = output.metrics
    span.set_attributes(
        {
            "gen_ai.usage.input_tokens": metrics.num_prompt_tokens,
            "gen_ai.usage.output_tokens": metrics.num_output_tokens,
            "gen_ai.response.finish_reasons": [output.finish_reason or "unknown"],
            "tollgate.seq": run.last_seq,
            "tollgate.cached_prompt_tokens": metrics.num_cached_prompt_tokens,
            "tollgate.num_preemptions": metrics.num_preemptions,
        }
    )
    if metrics.ttft is not None:
        span.set_attribute("tollgate.ttft_seconds", metrics.ttft)
    if metrics.queue_time is not None:
        span.set_attribute("tollgate.engine_queue_seconds", metrics.queue_time)
    if output.finish_reason not in COMPLETED_REASONS and output.finish_reason != "abort":
        span.set_status(Status(StatusCode.ERROR, f"finish reason {output.finish_reason}"))
    span.end()
    run.span = None
