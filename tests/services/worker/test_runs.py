from datetime import UTC, datetime
from typing import Any

import pytest

from engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from services.core.runs import RunState, StoredEvent
from services.worker.runs import AssignedRun, engine_lost_events, step_events

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
    [event] = step_events(RUN, [output((5, 6), "ab", None)], at=(3, 10))
    assert event.kind == RunState.STREAMING
    assert event.payload == {"token_ids": [5, 6], "text": "ab", "at": [3, 10]}


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
    assert streaming.payload == {"token_ids": [5, 6, 7], "text": "abc", "at": [0, 0]}
    assert completed.kind == RunState.COMPLETED


def test_each_answer_streams_apart_and_says_when_it_ends() -> None:
    run = AssignedRun(run_id="r1", tenant_id="t1", lease_epoch=1, last_seq=2, num_answers=2)

    def answer(
        index: int, tokens: tuple[int, ...], reason: str | None, last: bool = False
    ) -> RequestOutput:
        return RequestOutput("r1", tokens, "x" * len(tokens), last, reason, METRICS, index=index)

    outputs = [
        answer(0, (1,), None),
        answer(0, (2,), "stop"),
        answer(1, (3,), None),
        answer(0, (), None),
        answer(1, (4, 5), "length", last=True),
    ]
    *streamed, completed = step_events(run, outputs, at=(1, 1))
    # Where each stretch starts counts the run's output over all its answers.
    assert [e.payload for e in streamed] == [
        {"token_ids": [1, 2], "text": "xx", "at": [1, 1], "index": 0, "finish_reason": "stop"},
        {"token_ids": [3], "text": "x", "at": [3, 3], "index": 1},
        {"token_ids": [4, 5], "text": "xx", "at": [4, 4], "index": 1, "finish_reason": "length"},
    ]
    assert completed.kind == RunState.COMPLETED


def test_logprobs_travel_with_their_tokens_at_the_json_floor() -> None:
    entry = TokenLogprob(5, -0.25, ((5, -0.25), (9, float("-inf"))))
    with_logprobs = RequestOutput("r1", (5,), "a", False, None, METRICS, logprobs=(entry,))
    [event] = step_events(RUN, [with_logprobs])
    assert event.payload["logprobs"] == [
        {
            "token_id": 5,
            "logprob": -0.25,
            "top": [{"token_id": 5, "logprob": -0.25}, {"token_id": 9, "logprob": -9999.0}],
        }
    ]


def test_the_prompt_s_logprobs_travel_with_the_first_tokens() -> None:
    scored = (TokenLogprob(7, -1.5), TokenLogprob(8, -0.5, ((8, -0.5),)))
    first = RequestOutput("r1", (5,), "a", False, None, METRICS, prompt_logprobs=scored)
    later = RequestOutput("r1", (6,), "b", False, None, METRICS)
    [event] = step_events(RUN, [first, later])
    assert event.payload["prompt_logprobs"] == [
        {"token_id": 7, "logprob": -1.5, "top": []},
        {"token_id": 8, "logprob": -0.5, "top": [{"token_id": 8, "logprob": -0.5}]},
    ]
    assert "logprobs" not in event.payload


def test_outputs_without_tokens_make_no_event() -> None:
    assert step_events(RUN, [output((), "", None), output((), "", None)]) == []


def stored(*kinds_payloads: tuple[RunState, dict[str, Any]]) -> list[StoredEvent]:
    now = datetime.now(UTC)
    return [
        StoredEvent("r1", seq, kind, "t1", payload, now)
        for seq, (kind, payload) in enumerate(kinds_payloads, start=1)
    ]


QUEUED = {"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 8}}


def test_a_run_of_a_dead_engine_not_started_yet_gets_its_prefill_and_goes_back() -> None:
    prefill, queued = engine_lost_events(stored((RunState.QUEUED, QUEUED)), "w1", 4)
    assert (prefill.kind, prefill.payload) == (
        RunState.PREFILL,
        {"worker_id": "w1", "lease_epoch": 4},
    )
    assert queued.kind == RunState.QUEUED
    assert queued.payload == {**QUEUED, "requeue_reason": "ENGINE_ERROR"}


def test_a_run_of_a_dead_engine_that_streamed_fails_with_engine_error() -> None:
    history = stored(
        (RunState.QUEUED, QUEUED),
        (RunState.PREFILL, {"worker_id": "w1"}),
        (RunState.STREAMING, {"token_ids": [5, 6], "text": "ab"}),
    )
    [failed] = engine_lost_events(history, "w1", 1)
    assert failed.kind == RunState.FAILED
    assert failed.payload["code"] == "ENGINE_ERROR"
    assert failed.payload["usage"] == {
        "prompt_tokens": 3,
        "cached_prompt_tokens": 0,
        "output_tokens": 2,
    }


def test_a_run_of_a_dead_engine_that_ended_meanwhile_needs_nothing() -> None:
    history = stored(
        (RunState.QUEUED, QUEUED),
        (RunState.PREFILL, {}),
        (RunState.CANCELLED, {"reason": "client"}),
    )
    assert engine_lost_events(history, "w1", 1) == []
