"""The run state machine and the `runs` projection, free of I/O.

Every event kind names the state it leads to, so `kind` and `state` share one
vocabulary: appending a `streaming` event puts the run in state `streaming`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any


class RunState(StrEnum):
    QUEUED = "queued"
    PREFILL = "prefill"
    STREAMING = "streaming"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    BILLED = "billed"


# An event's kind is the state it moves the run to.
EventKind = RunState

TERMINAL_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED})
# A run has ended once terminal: nothing runs any more, and billing, which follows, adds no work.
ENDED_STATES = TERMINAL_STATES | {RunState.BILLED}

# None is the state of a run that has no events yet.  prefill -> queued is the
# re-queue of a run whose worker was lost before it emitted anything.
_TRANSITIONS: Mapping[RunState | None, frozenset[RunState]] = {
    None: frozenset({RunState.QUEUED}),
    RunState.QUEUED: frozenset({RunState.PREFILL, RunState.FAILED, RunState.CANCELLED}),
    RunState.PREFILL: frozenset({RunState.QUEUED, RunState.STREAMING, *TERMINAL_STATES}),
    RunState.STREAMING: frozenset({RunState.STREAMING, *TERMINAL_STATES}),
    RunState.COMPLETED: frozenset({RunState.BILLED}),
    RunState.FAILED: frozenset({RunState.BILLED}),
    RunState.CANCELLED: frozenset({RunState.BILLED}),
    RunState.BILLED: frozenset(),
}


class EventStoreError(Exception):
    """Base of every error the event store raises; nothing was written."""


class IllegalTransition(EventStoreError):
    def __init__(self, run_id: str, state: RunState | None, kind: RunState) -> None:
        super().__init__(f"run {run_id}: {kind} is not allowed after {state or 'nothing'}")
        self.run_id = run_id
        self.state = state
        self.kind = kind


def may_transition(state: RunState | None, kind: RunState) -> bool:
    return kind in _TRANSITIONS[state]


def is_terminal(state: RunState | None) -> bool:
    return state in TERMINAL_STATES


def is_ended(state: RunState | None) -> bool:
    return state in ENDED_STATES


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append: its kind and the JSON form of its protobuf message."""

    kind: RunState
    payload: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    run_id: str
    seq: int
    kind: RunState
    tenant_id: str
    payload: Mapping[str, Any]
    created_at: datetime
    traceparent: str = ""
    # A `streaming` event not stored yet (`services.core.live`): `seq` is the last
    # stored event's.
    live: bool = False


@dataclass(frozen=True, slots=True)
class NewRun:
    """What the first append of a run records besides its `queued` event."""

    tenant_id: str
    model: str
    priority: str = "interactive"
    idempotency_key: str | None = None
    request_hash: str | None = None


@dataclass(frozen=True, slots=True)
class RunView:
    """One row of the `runs` projection."""

    run_id: str
    tenant_id: str
    model: str
    priority: str
    state: RunState | None
    last_seq: int
    lease_epoch: int = 0
    owner: str | None = None
    idempotency_key: str | None = None
    request_hash: str | None = None
    finish_reason: str | None = None
    usage: Mapping[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None
    updated_at: datetime | None = None

    @classmethod
    def new(cls, run_id: str, run: NewRun) -> RunView:
        return cls(
            run_id=run_id,
            tenant_id=run.tenant_id,
            model=run.model,
            priority=run.priority,
            state=None,
            last_seq=0,
            idempotency_key=run.idempotency_key,
            request_hash=run.request_hash,
        )


def apply_events(view: RunView, events: Iterable[NewEvent]) -> RunView:
    """Folds `events` into `view`; raises IllegalTransition on the first bad one."""
    for event in events:
        view = _apply(view, event)
    return view


def _apply(view: RunView, event: NewEvent) -> RunView:
    if not may_transition(view.state, event.kind):
        raise IllegalTransition(view.run_id, view.state, event.kind)
    changes: dict[str, Any] = {"state": event.kind, "last_seq": view.last_seq + 1}
    if "usage" in event.payload:
        changes["usage"] = dict(event.payload["usage"])
    if event.kind == RunState.COMPLETED:
        changes["finish_reason"] = event.payload.get("finish_reason", "")
    elif event.kind in (RunState.FAILED, RunState.CANCELLED):
        changes["finish_reason"] = str(event.kind)
    return dataclasses.replace(view, **changes)
