"""The Responses API's pure halves: a request into admission's parameters, and a run's
stored events into the Response object and its numbered events, checked against the
`openai` SDK's types."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.admission.http.response_view import ResponseView, output_turns, replay
from services.admission.http.responses_api import (
    ResponseRequest,
    response_id_of,
    response_param_names,
    response_params,
    run_id_of,
    turn_json,
    turn_of,
    with_ids,
)
from services.admission.requests import ChatTurn, Limits
from services.admission.response_store import ResponseRecord
from services.core.errors import InvalidArgument, NotFound
from services.core.runs import RunState, StoredEvent
from tests.openai_types import parse_event, parse_response

LIMITS = Limits(max_tokens=4096, default_disconnect_grace=30.0)
RUN = "run_0123abcd"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
USAGE = {"prompt_tokens": 7, "cached_prompt_tokens": 2, "output_tokens": 3}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def translate(previous: Sequence[ChatTurn] = (), **fields: Any) -> Any:
    body = ResponseRequest.model_validate({"model": "m", "input": "hi", **fields})
    return response_params(body, {}, LIMITS, previous)


def record(**request: Any) -> ResponseRecord:
    body = ResponseRequest.model_validate({"model": "m", "input": "hi", **request})
    translated = response_params(body, {}, LIMITS)
    return ResponseRecord(RUN, "t1", translated.request, with_ids(translated.input_items, RUN))


def events(*kinds: tuple[RunState, dict[str, Any]]) -> list[StoredEvent]:
    return [
        StoredEvent(RUN, seq, kind, "t1", payload, T0 + timedelta(seconds=seq))
        for seq, (kind, payload) in enumerate(kinds, start=1)
    ]


def text_run(*texts: str, finish: str = "stop", billed: bool = True) -> list[StoredEvent]:
    kinds = [(RunState.QUEUED, {}), (RunState.PREFILL, {})]
    kinds += [(RunState.STREAMING, {"text": text}) for text in texts]
    kinds.append((RunState.COMPLETED, {"finish_reason": finish, "usage": USAGE}))
    if billed:
        kinds.append((RunState.BILLED, {}))
    return events(*kinds)


def types_of(out: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in out]


def test_response_ids_name_runs_one_to_one() -> None:
    assert response_id_of(RUN) == "resp_0123abcd"
    assert run_id_of(response_id_of(RUN)) == RUN
    with pytest.raises(NotFound):
        run_id_of(RUN)


def test_input_and_instructions_become_chat_turns_after_the_previous_ones() -> None:
    previous = (ChatTurn("user", "one"), ChatTurn("assistant", "two"))
    translated = translate(
        previous,
        instructions="be brief",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "three"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        max_output_tokens=9,
        temperature=0,
        metadata={"k": "v"},
    )
    params = translated.params
    assert [m.role for m in params.messages] == [
        "system", "user", "assistant", "user", "assistant", "tool"
    ]  # fmt: skip
    assert params.messages[0].content == "be brief"
    assert params.messages[4].tool_calls[0].name == "f"
    assert params.messages[5].tool_call_id == "c1"
    assert params.sampling.max_tokens == 9 and params.sampling.temperature == 0
    # Instructions are not inherited by a next turn.
    assert [t.role for t in translated.conversation][0] == "user"
    assert translated.request["metadata"] == {"k": "v"}
    assert not params.detached
    items = with_ids(translated.input_items, RUN)
    assert [item["id"] for item in items] == [
        "msg_0123abcd_in0",
        "fc_0123abcd_in1",
        "fco_0123abcd_in2",
    ]
    assert [turn_of(turn_json(t)) for t in translated.conversation] == list(translated.conversation)


def test_background_runs_are_detached_and_tools_become_a_structure() -> None:
    translated = translate(
        background=True,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    )
    assert translated.params.detached
    structure = translated.params.sampling.structure
    assert structure.tools[0].name == "get_weather"
    assert structure.tool_choice == "function" and structure.function == "get_weather"
    assert structure.response_format == "json_schema"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True, "store": False}, "background"),
        ({"input": []}, "input"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": ["x"]}]}, "input[0].content"),
        ({"input": [{"type": {"a": 1}}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "output": 1}]}, "input[0].output"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        translate(**fields)
    assert refused.value.violations[0].field == param


def test_admission_fields_are_named_as_the_responses_api_names_them() -> None:
    body = ResponseRequest.model_validate({"model": "m", "input": "x", "tools": [WEATHER]})
    names = response_param_names(body)
    assert names["sampling.max_tokens"] == "max_output_tokens"
    assert names["messages"] == "input"
    assert names["sampling.tools[0].parameters"] == "tools[0].parameters"


def test_a_text_run_becomes_openai_events_numbered_by_where_they_stand() -> None:
    view, out = replay(record(), "m", text_run("Hel", "lo"))
    assert types_of(out) == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    # Other events count one each, text deltas the characters they send.
    assert [e["sequence_number"] for e in out] == [0, 1, 2, 3, 4, 7, 9, 10, 11, 12, 13]
    for event in out:
        parse_event(event)
    response = parse_response(view.body())
    assert response.status == "completed"
    assert response.output_text == "Hello"
    assert response.usage is not None
    assert response.usage.input_tokens == 7 and response.usage.total_tokens == 10
    assert response.usage.input_tokens_details.cached_tokens == 2
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.id == "resp_0123abcd"


def test_numbering_is_the_same_on_every_replay_and_resuming_gives_the_tail() -> None:
    stored = text_run("a", "b", "c", "d")
    _, whole = replay(record(), "m", stored)
    assert replay(record(), "m", stored)[1] == whole
    for n, event in enumerate(whole):
        assert replay(record(), "m", stored, after=event["sequence_number"])[1] == whole[n + 1 :]
    # Events in flight: a resumed stream goes on as the whole one.
    view = ResponseView(record(), "m")
    first = [e for event in stored[:3] for e in view.events(event)]
    rest = [e for event in stored[3:] for e in view.events(event)]
    assert first + rest == whole


def test_the_numbers_do_not_depend_on_the_pieces_the_text_came_in() -> None:
    _, pieces = replay(record(), "m", text_run("a", "bc", "def"))
    _, whole = replay(record(), "m", text_run("abcdef"))

    def others(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
        return [
            (e["type"], e["sequence_number"])
            for e in events
            if e["type"] != "response.output_text.delta"
        ]

    assert others(pieces) == others(whole)
    # A client that had the pieces up to "abc" resumes in the stored whole: it gets "def".
    after = next(e["sequence_number"] for e in pieces if e.get("delta") == "bc")
    [delta, *_] = replay(record(), "m", text_run("abcdef"), after=after)[1]
    assert delta["delta"] == "def" and delta["sequence_number"] == after + 3
    for n, event in enumerate(pieces):  # a client that had the pieces up to any of them
        number = event["sequence_number"]
        tail = replay(record(), "m", text_run("abcdef"), after=number)[1]
        assert delta_text(pieces[: n + 1]) + delta_text(tail) == "abcdef"


def delta_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


@pytest.mark.parametrize(
    ("stored", "status", "last"),
    [
        (events((RunState.QUEUED, {})), "queued", "response.queued"),
        (events((RunState.QUEUED, {}), (RunState.PREFILL, {})), "in_progress", None),
        (text_run("x"), "completed", "response.completed"),
        (text_run("x", finish="length"), "incomplete", "response.incomplete"),
        (
            events(
                (RunState.QUEUED, {}),
                (RunState.PREFILL, {}),
                (RunState.STREAMING, {"text": "x"}),
                (RunState.FAILED, {"code": "WORKER_LOST", "message": "lost", "usage": USAGE}),
            ),
            "failed",
            "response.failed",
        ),
        (
            events((RunState.QUEUED, {}), (RunState.CANCELLED, {"reason": "by client"})),
            "cancelled",
            "response.queued",
        ),
    ],
)
def test_each_status_comes_from_the_run_events(
    stored: list[StoredEvent], status: str, last: str | None
) -> None:
    view, out = replay(record(background=True), "m", stored)
    for event in out:
        parse_event(event)
    response = parse_response(view.body())
    assert response.status == status
    assert response.background is True
    if last is not None:
        assert out[-1]["type"] == last
    if status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    if status == "failed":
        assert response.error is not None and response.error.message == "lost"


def test_calls_are_held_back_then_given_as_function_call_items() -> None:
    call = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]})
    view, out = replay(record(tools=[WEATHER]), "m", text_run(call[:5], call[5:]))
    assert types_of(out)[3:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    for event in out:
        parse_event(event)
    response = parse_response(view.body())
    [item] = response.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Oslo"}
    [turn] = output_turns(view)
    assert turn.tool_calls[0].id == item.call_id


def test_text_of_a_run_with_tools_streams_once_it_cannot_be_a_call() -> None:
    view, out = replay(record(tools=[WEATHER]), "m", text_run("It is ", "sunny"))
    deltas = [e["delta"] for e in out if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "It is sunny"
    assert output_turns(view) == (ChatTurn("assistant", "It is sunny"),)


def test_the_response_echoes_the_request() -> None:
    view, _ = replay(
        record(
            instructions="be brief",
            metadata={"a": "b"},
            temperature=0.5,
            top_p=0.9,
            max_output_tokens=20,
            tools=[WEATHER],
            text={"format": {"type": "json_object"}},
            previous_response_id="resp_99",
        ),
        "m",
        text_run("{}"),
    )
    response = parse_response(view.body())
    assert response.instructions == "be brief"
    assert response.metadata == {"a": "b"}
    assert response.temperature == 0.5 and response.top_p == 0.9
    assert response.max_output_tokens == 20
    assert response.tools[0].name == "get_weather"  # type: ignore[union-attr]
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_object"
    assert response.previous_response_id == "resp_99"
