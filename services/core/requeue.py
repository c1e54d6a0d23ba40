"""What becomes of a run that lost what ran it (its worker, or its worker's engine), free of I/O.

A run that emitted no `streaming` event may run again: it gets a new `queued`
event naming why (`requeue_reason`). A run that streamed is never re-run
(DESIGN §1): it ends `failed` with the usage actually delivered. Re-queues are
bounded: a run already re-queued `MAX_REQUEUES` times ends `failed`
`REQUEUE_LIMIT` instead, so a request that crashes whatever runs it cannot take
down every worker in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.core.runs import NewEvent, RunState, StoredEvent

# Failure codes (`Failed.code`, DESIGN §8); the first two are also requeue reasons.
WORKER_LOST = "WORKER_LOST"
ENGINE_ERROR = "ENGINE_ERROR"
REQUEUE_LIMIT = "REQUEUE_LIMIT"

MAX_REQUEUES = 3


def latest(events: Sequence[StoredEvent], kind: RunState) -> StoredEvent | None:
    return next((e for e in reversed(events) if e.kind == kind), None)


def num_requeues(events: Sequence[StoredEvent]) -> int:
    """How often the run went back to the queue: every `queued` event after the first."""
    return max(0, sum(e.kind == RunState.QUEUED for e in events) - 1)


def delivered_usage(events: Sequence[StoredEvent]) -> dict[str, int]:
    """Prompt, cached prompt and streamed tokens as far as the events show."""
    queued = latest(events, RunState.QUEUED)
    prefill = latest(events, RunState.PREFILL)
    return {
        "prompt_tokens": len(queued.payload.get("prompt_token_ids", [])) if queued else 0,
        "cached_prompt_tokens": int(prefill.payload.get("cached_prompt_tokens", 0))
        if prefill
        else 0,
        "output_tokens": sum(
            len(e.payload.get("token_ids", [])) for e in events if e.kind == RunState.STREAMING
        ),
    }


def requeue_or_fail(events: Sequence[StoredEvent], reason: str) -> NewEvent:
    """For a run that emitted nothing: `queued` again with `reason`, or `failed`
    REQUEUE_LIMIT once it was re-queued MAX_REQUEUES times."""
    if num_requeues(events) >= MAX_REQUEUES:
        return failed(
            events,
            REQUEUE_LIMIT,
            f"re-queued {MAX_REQUEUES} times; the last attempt ended with {reason}",
        )
    queued = latest(events, RunState.QUEUED)
    payload: dict[str, Any] = dict(queued.payload) if queued is not None else {}
    payload["requeue_reason"] = reason
    return NewEvent(RunState.QUEUED, payload)


def failed(events: Sequence[StoredEvent], code: str, message: str) -> NewEvent:
    return NewEvent(
        RunState.FAILED, {"code": code, "message": message, "usage": delivered_usage(events)}
    )


def prefill_event(worker_id: str, lease_epoch: int) -> NewEvent:
    """What a worker appends as it starts a run."""
    return NewEvent(RunState.PREFILL, {"worker_id": worker_id, "lease_epoch": lease_epoch})


def lost_run_events(
    events: Sequence[StoredEvent], code: str, message: str, prefill: NewEvent
) -> list[NewEvent]:
    """What settles a run whose worker or engine was lost, given its stored events: as
    `lost_run_event`, nothing for a run that ended meanwhile, and for one assigned whose
    `prefill` was not stored yet `prefill` and then the re-queue, so that the attempt
    counts towards the re-queue limit: a request that kills what runs it at once ends
    there too."""
    state = events[-1].kind if events else None
    if state == RunState.QUEUED:
        return [prefill, requeue_or_fail(events, code)]
    event = lost_run_event(events, code, message)
    return [event] if event is not None else []


def lost_run_event(events: Sequence[StoredEvent], code: str, message: str) -> NewEvent | None:
    """The event that settles a started run whose worker or engine was lost (`code`
    names which): re-queued (or REQUEUE_LIMIT) after `prefill`, `failed` `code` with
    `message` after `streaming`; None for a run in any other state."""
    state = events[-1].kind if events else None
    if state == RunState.PREFILL:
        return requeue_or_fail(events, code)
    if state == RunState.STREAMING:
        return failed(events, code, message)
    return None
