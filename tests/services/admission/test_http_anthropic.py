"""Anthropic's Messages API bodies into admission's parameters, and run events into
Anthropic's `message` object, stream events and error bodies: the pure half of
`services/admission/http/anthropic.py` and `anthropic_answers.py`."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from services.admission.http.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    count_params,
    message_params,
    param_names,
)
from services.admission.http.anthropic_answers import Message, anthropic_error, shaped_for
from services.admission.http.responses import http_error
from services.admission.requests import Limits, field_violations
from services.core import errors
from services.core.errors import FieldViolation, InvalidArgument, NotFound
from services.core.runs import RunState, StoredEvent
from tollgate.structure import tool_calls_of

LIMITS = Limits()
USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL_TEXT = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'


def params(headers: dict[str, str] | None = None, **fields: Any) -> Any:
    body = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 16, "messages": USER, **fields}
    )
    return message_params(body, headers or {}, LIMITS)


def refused_fields(**fields: Any) -> list[str]:
    with pytest.raises(InvalidArgument) as refused:
        params(**fields)
    return [v.field for v in refused.value.violations]


def event(seq: int, kind: RunState, **payload: Any) -> StoredEvent:
    return StoredEvent("run_1", seq, kind, "ten_1", payload, datetime(2026, 1, 1, tzinfo=UTC))


def test_sampling_fields_and_headers_become_the_run() -> None:
    run = params(
        {"idempotency-key": "k1", "x-tollgate-disconnect-grace": "2"},
        max_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        stop_sequences=["END", "STOP"],
        metadata={"user_id": "u1"},
        unknown_field=True,
    )
    sampling = run.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (9, 0.5, 0.9)
    assert (sampling.top_k, sampling.stop) == (4, ("END", "STOP"))
    assert (run.idempotency_key, run.disconnect_grace, run.until_terminal) == ("k1", 2.0, True)


def test_a_resumed_stream_names_the_request_it_resumes() -> None:
    assert params({"last-event-id": "3", "idempotency-key": "k1"}).idempotency_key == "k1"
    with pytest.raises(InvalidArgument) as refused:
        params({"last-event-id": "3"})
    assert refused.value.violations[0].field == "Last-Event-ID"


def test_max_tokens_is_required_as_anthropic_requires_it() -> None:
    with pytest.raises(ValidationError, match="max_tokens"):
        MessagesRequest.model_validate({"model": "m", "messages": USER})


def test_system_and_text_blocks_become_turns() -> None:
    run = params(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "c"},
        ],
    )
    assert [tuple(m[:2]) for m in run.messages] == [
        ("system", "Be brief."),
        ("user", "ab"),
        ("assistant", "c"),
    ]


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_turns() -> None:
    run = params(
        tools=[WEATHER],
        messages=[
            USER[0],
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And Paris?"},
                ],
            },
        ],
    )  # fmt: skip
    user, assistant, tool, follow_up = run.messages
    assert assistant.content == "Looking."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        ("t1", "get_weather", {"city": "Oslo"})
    ]
    assert (tool.role, tool.content, tool.tool_call_id) == ("tool", "sunny", "t1")
    assert tuple(follow_up[:2]) == ("user", "And Paris?")


@pytest.mark.parametrize(
    ("choice", "mode", "function", "parallel"),
    [
        (None, "auto", "", True),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", "", False),
        ({"type": "any"}, "required", "", True),
        ({"type": "tool", "name": "get_weather"}, "function", "get_weather", True),
        ({"type": "none"}, "none", "", True),
    ],
)
def test_tools_and_tool_choice_become_the_structure(
    choice: dict[str, Any] | None, mode: str, function: str, parallel: bool
) -> None:
    structure = params(tools=[WEATHER], tool_choice=choice).sampling.structure
    (tool,) = structure.tools
    assert (tool.name, tool.description) == ("get_weather", "The weather in a city")
    assert json.loads(tool.parameters) == WEATHER["input_schema"]
    assert (structure.tool_choice, structure.function) == (mode, function)
    assert structure.parallel_tool_calls is parallel
    assert structure.tool_format == ""  # the gateway chooses the model's own


def test_an_output_format_constrains_the_answer_to_its_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    output_config = {"effort": "low", "format": {"type": "json_schema", "schema": schema}}
    structure = params(output_config=output_config).sampling.structure
    assert (structure.response_format, json.loads(structure.json_schema)) == ("json_schema", schema)
    assert params(output_config={"effort": "low"}).sampling.structure.response_format == "text"
    assert refused_fields(output_config={"format": {"type": "xml"}}) == ["output_config.format"]


def test_what_cannot_be_honoured_is_refused_by_name() -> None:
    image = {"type": "image", "source": {"type": "base64", "data": ""}}
    fields = refused_fields(
        messages=[
            {"role": "user", "content": [image]},
            {"role": "system", "content": "x"},
            {"role": "user", "content": [{"type": "tool_result", "content": ["not a block"]}]},
        ],
        thinking={"type": "enabled", "budget_tokens": 1024},
        tools=[{"type": "web_search_20250305", "name": "web_search"}],
        tool_choice={"type": "sometimes"},
    )
    assert set(fields) == {
        "messages[0].content[0].type",
        "messages[1].role",
        "messages[2].content[0].content[0].type",
        "thinking",
        "tools[0].type",
        "tool_choice.type",
    }
    assert params(thinking={"type": "disabled"}).sampling.max_tokens == 16


def test_admissions_field_paths_are_told_by_anthropics_names() -> None:
    body = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 0, "messages": USER, "tools": [{"name": "bad name"}]}
    )
    run = message_params(body, {}, LIMITS)
    names = param_names(body)
    reported = {names.get(v.field, v.field) for v in field_violations(run, ["m"], LIMITS)}
    assert {"max_tokens", "tools[0].name"} <= reported


def test_count_tokens_takes_the_body_without_max_tokens() -> None:
    body = CountTokensRequest.model_validate({"model": "m", "messages": USER, "tools": [WEATHER]})
    run = count_params(body, LIMITS)
    assert run.messages[0].content == "hi"
    assert run.sampling.structure.tools[0].name == "get_weather"


def sse_events(frames: list[bytes]) -> list[tuple[str, int | None, dict[str, Any]]]:
    """(event name, id or None, data) of each frame."""
    parsed = []
    for frame in frames:
        fields = dict(line.split(": ", 1) for line in frame.decode().strip().split("\n"))
        seq = int(fields["id"]) if "id" in fields else None
        parsed.append((fields["event"], seq, json.loads(fields["data"])))
    return parsed


ENDING = ["content_block_stop", "message_delta", "message_stop"]
RUN = [
    event(1, RunState.QUEUED, prompt_token_ids=[1, 2, 3]),
    event(2, RunState.PREFILL),
    event(3, RunState.STREAMING, text="Hel"),
    event(4, RunState.STREAMING, text="lo"),
    event(
        5,
        RunState.COMPLETED,
        finish_reason="length",
        usage={"prompt_tokens": 3, "output_tokens": 2},
    ),
]


def test_a_text_stream_has_anthropics_events_in_order() -> None:
    message = Message("run_1", "m", tools=False)
    events = sse_events([f for e in RUN for f in message.frames(e)])
    names = "message_start content_block_start ping content_block_delta content_block_delta"
    assert [name for name, _, _ in events] == [*names.split(), *ENDING]
    start = events[0][2]["message"]
    assert (start["id"], start["model"], start["usage"]["input_tokens"]) == ("run_1", "m", 3)
    assert [e[2]["delta"]["text"] for e in events if e[0] == "content_block_delta"] == ["Hel", "lo"]
    delta = events[-2][2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"output_tokens": 2}


def test_only_the_last_event_of_a_run_event_carries_its_seq() -> None:
    message = Message("run_1", "m", tools=False)
    for run_event in RUN:
        ids = [seq for _, seq, _ in sse_events(message.frames(run_event))]
        if ids:
            assert ids == [None] * (len(ids) - 1) + [run_event.seq]


@pytest.mark.parametrize("last_seen", [1, 3, 4])
def test_a_stream_resumed_after_a_seq_goes_on_with_exactly_what_follows(last_seen: int) -> None:
    unbroken = Message("run_1", "m", tools=False)
    whole = [f for e in RUN for f in unbroken.frames(e)]
    first = Message("run_1", "m", tools=False)
    before = [f for e in RUN if e.seq <= last_seen for f in first.frames(e)]
    resumed = Message("run_1", "m", tools=False)
    after = [f for e in RUN for f in resumed.frames(e) if e.seq > last_seen]
    assert before + after == whole
    assert sse_events(before)[-1][1] == last_seen  # what the client's Last-Event-ID says


def test_the_whole_message_and_its_stop_reasons() -> None:
    message = Message("run_1", "m", tools=False)
    for run_event in RUN:
        message.add(run_event)
    assert message.body() == {
        "id": "run_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 3,
            "output_tokens": 2,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    for reason, stop, told in [
        ("stop", (), ("end_turn", None)),
        ("stop_sequence", ("END",), ("stop_sequence", "END")),
        ("stop_sequence", ("END", "STOP"), ("stop_sequence", None)),
    ]:
        ended = Message("run_1", "m", tools=False, stop_sequences=stop)
        ended.add(event(3, RunState.COMPLETED, finish_reason=reason, usage={}))
        assert (ended.body()["stop_reason"], ended.body()["stop_sequence"]) == told


def test_calls_are_held_back_then_given_as_tool_use_blocks() -> None:
    run = [
        RUN[0],
        event(2, RunState.STREAMING, text=CALL_TEXT[:20]),
        event(3, RunState.STREAMING, text=CALL_TEXT[20:]),
        event(4, RunState.COMPLETED, finish_reason="stop", usage={"output_tokens": 9}),
    ]
    streamed = Message("run_1", "m", tools=True)
    events = sse_events([f for e in run for f in streamed.frames(e)])
    names = "message_start content_block_start ping content_block_delta"
    assert [name for name, _, _ in events] == [*names.split(), *ENDING]
    (call,) = tool_calls_of(CALL_TEXT, "run_1") or ()
    block = events[1][2]["content_block"]
    assert block == {"type": "tool_use", "id": call.id, "name": "get_weather", "input": {}}
    assert json.loads(events[3][2]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert events[5][2]["delta"]["stop_reason"] == "tool_use"
    whole = Message("run_1", "m", tools=True)
    for run_event in run:
        whole.add(run_event)
    assert whole.body()["content"] == [
        {"type": "tool_use", "id": call.id, "name": "get_weather", "input": {"city": "Oslo"}}
    ]
    assert whole.body()["stop_reason"] == "tool_use"


def test_a_failed_run_ends_the_stream_with_an_error_event() -> None:
    message = Message("run_1", "m", tools=False)
    message.frames(RUN[0])
    failed = event(2, RunState.FAILED, code="WORKER_LOST", message="worker lost")
    ((name, seq, data),) = sse_events(message.frames(failed))
    assert (name, seq) == ("error", 2)
    assert data == {"type": "error", "error": {"type": "api_error", "message": "worker lost"}}


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (
            InvalidArgument([FieldViolation("max_tokens", "Field required")]),
            400,
            "invalid_request_error",
        ),
        (errors.Unauthenticated("bad key"), 401, "authentication_error"),
        (NotFound("model: 'x' not found"), 404, "not_found_error"),
        (errors.QuotaExceeded("over", "tenant:t:rpm", 2.5), 429, "rate_limit_error"),
        (errors.Unavailable("busy", retry_after=1.0), 529, "overloaded_error"),
    ],
)
def test_errors_are_told_in_anthropics_body_and_statuses(
    error: Any, status: int, kind: str
) -> None:
    answer = anthropic_error(http_error(error))
    assert answer.status == status
    assert answer.body["type"] == "error"
    assert answer.body["error"]["type"] == kind
    assert answer.body["error"]["message"]
    if status in (429, 529):
        assert int(answer.headers["retry-after"]) >= 1


def test_only_the_messages_paths_get_anthropics_error_shape() -> None:
    answer = http_error(NotFound("nothing"))
    assert shaped_for("/v1/messages", answer).body["type"] == "error"
    assert shaped_for("/v1/messages/count_tokens", answer).body["type"] == "error"
    assert shaped_for("/v1/chat/completions", answer) is answer
    assert shaped_for("/v1/messagesx", answer) is answer
