import pytest

from services.core.runs import (
    IllegalTransition,
    NewEvent,
    NewRun,
    RunState,
    RunView,
    apply_events,
)

S = RunState


def fold(*kinds: RunState) -> RunView:
    view = RunView.new("r1", NewRun(tenant_id="t1", model="m"))
    return apply_events(view, [NewEvent(kind) for kind in kinds])


def test_full_lifecycle_counts_seq_and_ends_billed() -> None:
    view = fold(S.QUEUED, S.PREFILL, S.STREAMING, S.STREAMING, S.COMPLETED, S.BILLED)
    assert view.state == S.BILLED
    assert view.last_seq == 6


@pytest.mark.parametrize(
    "kinds",
    [
        (S.QUEUED, S.PREFILL, S.STREAMING, S.COMPLETED, S.STREAMING),
        (S.QUEUED, S.PREFILL, S.STREAMING, S.COMPLETED, S.FAILED),
        (S.QUEUED, S.CANCELLED, S.CANCELLED),
        (S.QUEUED, S.CANCELLED, S.BILLED, S.BILLED),
        (S.QUEUED, S.CANCELLED, S.BILLED, S.QUEUED),
        (S.QUEUED, S.PREFILL, S.STREAMING, S.BILLED),
        (S.QUEUED, S.BILLED),
        (S.PREFILL,),
        (S.QUEUED, S.QUEUED),
        (S.QUEUED, S.STREAMING),
    ],
    ids=lambda kinds: "-".join(kinds),
)
def test_illegal_sequences_are_rejected(kinds: tuple[RunState, ...]) -> None:
    with pytest.raises(IllegalTransition):
        fold(*kinds)


def test_requeue_before_any_output_is_legal() -> None:
    assert fold(S.QUEUED, S.PREFILL, S.QUEUED, S.PREFILL, S.STREAMING).state == S.STREAMING


def test_terminal_payload_sets_usage_and_finish_reason() -> None:
    view = fold(S.QUEUED, S.PREFILL, S.STREAMING)
    usage = {"prompt_tokens": 3, "output_tokens": 5}
    done = apply_events(view, [NewEvent(S.COMPLETED, {"finish_reason": "length", "usage": usage})])
    assert done.finish_reason == "length"
    assert done.usage == usage
    cancelled = apply_events(view, [NewEvent(S.CANCELLED, {"reason": "client"})])
    assert cancelled.finish_reason == "cancelled"
