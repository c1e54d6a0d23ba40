from datetime import UTC, datetime
from typing import Any

from services.core.runs import RunState, StoredEvent
from services.scheduler.recovery import lost_worker_events

QUEUED = {
    "model": "tiny",
    "priority": "PRIORITY_INTERACTIVE",
    "sampling": {"max_tokens": 8},
    "prompt_token_ids": [1, 2, 3],
    "idempotency_key": "k",
    "num_kv_blocks": 1,
}


def events(*kinds_payloads: tuple[RunState, dict[str, Any]]) -> list[StoredEvent]:
    now = datetime.now(UTC)
    return [
        StoredEvent("r", seq, kind, "t", payload, now)
        for seq, (kind, payload) in enumerate(kinds_payloads, start=1)
    ]


def test_a_run_that_only_started_prefill_is_requeued_with_its_payload() -> None:
    [event] = lost_worker_events(
        events((RunState.QUEUED, QUEUED), (RunState.PREFILL, {"worker_id": "w"})), "w", 2
    )
    assert event.kind == RunState.QUEUED
    assert event.payload == {**QUEUED, "requeue_reason": "WORKER_LOST"}


def test_a_run_that_streamed_fails_with_the_usage_delivered() -> None:
    [event] = lost_worker_events(
        events(
            (RunState.QUEUED, QUEUED),
            (RunState.PREFILL, {"worker_id": "w", "cached_prompt_tokens": "2"}),
            (RunState.STREAMING, {"token_ids": [5, 6], "text": "ab"}),
            (RunState.STREAMING, {"token_ids": [7], "text": "c"}),
        ),
        "w",
        2,
    )
    assert event.kind == RunState.FAILED
    assert event.payload["code"] == "WORKER_LOST"
    assert event.payload["usage"] == {
        "prompt_tokens": 3,
        "cached_prompt_tokens": 2,
        "output_tokens": 3,
    }


def test_an_assigned_run_not_started_counts_an_attempt_and_an_ended_run_needs_nothing() -> None:
    prefill, queued = lost_worker_events(events((RunState.QUEUED, QUEUED)), "w", 2)
    assert (prefill.kind, prefill.payload) == (
        RunState.PREFILL,
        {"worker_id": "w", "lease_epoch": 2},
    )
    assert queued.payload == {**QUEUED, "requeue_reason": "WORKER_LOST"}
    done = events(
        (RunState.QUEUED, QUEUED),
        (RunState.PREFILL, {}),
        (RunState.COMPLETED, {"finish_reason": "length"}),
    )
    assert lost_worker_events(done, "w", 2) == []


def test_a_run_requeued_three_times_fails_at_the_requeue_limit_the_next_time() -> None:
    requeued = {**QUEUED, "requeue_reason": "ENGINE_ERROR"}
    history = [(RunState.QUEUED, QUEUED)]
    for _ in range(3):
        history += [(RunState.PREFILL, {"worker_id": "w"}), (RunState.QUEUED, requeued)]
    history.append((RunState.PREFILL, {"worker_id": "w"}))
    [event] = lost_worker_events(events(*history), "w", 2)
    assert event.kind == RunState.FAILED
    assert event.payload["code"] == "REQUEUE_LIMIT"
    assert event.payload["usage"]["output_tokens"] == 0
    # One re-queue fewer, and it goes back to the queue once more.
    [again] = lost_worker_events(events(*history[:-3], history[-1]), "w", 2)
    assert again.kind == RunState.QUEUED
    # The same bound holds for a run that took its worker down before its prefill.
    _, limited = lost_worker_events(events(*history[:-1]), "w", 2)
    assert limited.payload["code"] == "REQUEUE_LIMIT"
