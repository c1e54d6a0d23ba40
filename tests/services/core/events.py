"""Small builders for run events used across the core tests."""

import uuid

from services.core.event_store import EventStore
from services.core.runs import NewEvent, NewRun, RunState, StoredEvent


def new_run_id() -> str:
    return str(uuid.uuid4())


async def start_run(store: EventStore, run_id: str | None = None, tenant_id: str = "t1") -> str:
    run_id = run_id or new_run_id()
    await store.append(
        run_id,
        0,
        [NewEvent(RunState.QUEUED, {"model": "tiny", "prompt_token_ids": [1, 2, 3]})],
        new_run=NewRun(tenant_id=tenant_id, model="tiny"),
    )
    return run_id


def streaming(*token_ids: int) -> NewEvent:
    return NewEvent(
        RunState.STREAMING, {"token_ids": list(token_ids), "text": "x" * len(token_ids)}
    )


def seqs(events: list[StoredEvent]) -> list[int]:
    return [event.seq for event in events]
