"""The runs a worker holds, and the events an engine step turns into (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestMetrics, RequestOutput
from services.core.runs import NewEvent, RunState

COMPLETED_REASONS = frozenset({"stop", "length", "stop_sequence"})


@dataclass(slots=True)
class AssignedRun:
    """A run on this worker: where its event stream stands and under which lease."""

    run_id: str
    tenant_id: str
    lease_epoch: int
    last_seq: int
    traceparent: str = ""
    cancel_reason: str | None = None
    # KV blocks held back for the run's whole length (prompt + max_tokens).
    num_reserved_blocks: int = 0


def usage_of(metrics: RequestMetrics) -> dict[str, Any]:
    return {
        "prompt_tokens": metrics.num_prompt_tokens,
        "cached_prompt_tokens": metrics.num_cached_prompt_tokens,
        "output_tokens": metrics.num_output_tokens,
        "kv_blocks_peak": metrics.kv_blocks_peak,
        "kv_block_seconds": round(metrics.kv_block_seconds, 6),
    }


def step_events(run: AssignedRun, output: RequestOutput) -> list[NewEvent]:
    """`streaming` for new tokens, then the terminal event if the request finished."""
    events = []
    if output.new_token_ids:
        events.append(
            NewEvent(
                RunState.STREAMING,
                {"token_ids": list(output.new_token_ids), "text": output.text_delta},
            )
        )
    if output.finished:
        events.append(terminal_event(run, output))
    return events


def terminal_event(run: AssignedRun, output: RequestOutput) -> NewEvent:
    usage = usage_of(output.metrics)
    if output.finish_reason in COMPLETED_REASONS:
        payload: dict[str, Any] = {"finish_reason": output.finish_reason, "usage": usage}
        if output.metrics.ttft is not None:
            payload["ttft_seconds"] = round(output.metrics.ttft, 6)
        return NewEvent(RunState.COMPLETED, payload)
    if output.finish_reason == "abort":
        return NewEvent(
            RunState.CANCELLED, {"reason": run.cancel_reason or "aborted", "usage": usage}
        )
    return NewEvent(
        RunState.FAILED,
        {
            "code": "ENGINE_ERROR",
            "message": f"finish reason {output.finish_reason}",
            "usage": usage,
        },
    )
