import pytest

from engine.outputs import RequestMetrics, RequestOutput
from services.core.runs import RunState
from services.worker.runs import AssignedRun, step_events

METRICS = RequestMetrics(
    arrival_time=0.0,
    queue_time=0.01,
    ttft=0.05,
    itl_mean=0.01,
    itl_max=0.02,
    num_prompt_tokens=7,
    num_cached_prompt_tokens=4,
    num_output_tokens=3,
    kv_blocks_peak=2,
    kv_block_seconds=0.5,
    num_preemptions=0,
)


def output(tokens: tuple[int, ...], text: str, reason: str | None) -> RequestOutput:
    return RequestOutput("r1", tokens, text, reason is not None, reason, METRICS)


RUN = AssignedRun(run_id="r1", tenant_id="t1", lease_epoch=1, last_seq=2)


def test_new_tokens_become_one_streaming_event() -> None:
    [event] = step_events(RUN, [output((5, 6), "ab", None)])
    assert event.kind == RunState.STREAMING
    assert event.payload == {"token_ids": [5, 6], "text": "ab"}


@pytest.mark.parametrize("reason", ["stop", "length", "stop_sequence"])
def test_finishing_appends_completed_with_usage(reason: str) -> None:
    streaming, completed = step_events(RUN, [output((9,), "", reason)])
    assert streaming.kind == RunState.STREAMING
    assert completed.kind == RunState.COMPLETED
    assert completed.payload["finish_reason"] == reason
    assert completed.payload["usage"] == {
        "prompt_tokens": 7,
        "cached_prompt_tokens": 4,
        "output_tokens": 3,
        "kv_blocks_peak": 2,
        "kv_block_seconds": 0.5,
    }
    assert completed.payload["ttft_seconds"] == 0.05


def test_an_abort_is_the_cancellation_with_its_reason() -> None:
    run = AssignedRun(
        run_id="r1", tenant_id="t1", lease_epoch=1, last_seq=2, cancel_reason="client gone"
    )
    [cancelled] = step_events(run, [output((), "", "abort")])
    assert cancelled.kind == RunState.CANCELLED
    assert cancelled.payload["reason"] == "client gone"
    assert cancelled.payload["usage"]["output_tokens"] == 3


def test_steps_that_piled_up_become_one_streaming_event_then_the_end() -> None:
    outputs = [output((5,), "a", None), output((), "", None), output((6, 7), "bc", "length")]
    streaming, completed = step_events(RUN, outputs)
    assert streaming.payload == {"token_ids": [5, 6, 7], "text": "abc"}
    assert completed.kind == RunState.COMPLETED


def test_outputs_without_tokens_make_no_event() -> None:
    assert step_events(RUN, [output((), "", None), output((), "", None)]) == []
