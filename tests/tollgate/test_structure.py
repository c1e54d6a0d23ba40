"""Response formats, tools, tool-carrying messages and logprobs as the SDK sends them, and
the calls and log-probabilities it reads back."""

import json
import re
from typing import Any

import pytest

from tests.tollgate.fake_gateway import logprob_of, script
from tollgate import convert
from tollgate.structure import Structure, may_open_calls, tool_calls_of
from tollgate.types import ChatMessage, TokenLogprob, ToolCall, TopLogprob
from tollgate.v1 import events_pb2

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}}


def request(
    messages: Any = None, logprobs: bool = False, top_logprobs: int = 0, **structure: Any
) -> events_pb2.GenerateRequest:
    return convert.generate_request(
        None if messages else "hi", messages=messages, model="tiny", max_tokens=4,
        temperature=None, top_k=None, top_p=None, seed=None, stop=(), stop_token_ids=(),
        priority="interactive", structure=Structure(**structure), logprobs=logprobs,
        top_logprobs=top_logprobs, idempotency_key=None, disconnect_grace=None,
        until_terminal=False,
    )  # fmt: skip


def test_nothing_asked_leaves_the_fields_unset() -> None:
    sampling = request().sampling
    assert not sampling.HasField("response_format") and not sampling.HasField("tool_choice")
    assert not sampling.tools and not sampling.HasField("parallel_tool_calls")
    assert (sampling.logprobs, sampling.top_logprobs) == (False, 0)


def test_openai_shapes_land_in_sampling_params() -> None:
    sampling = request(
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        logprobs=True,
        top_logprobs=3,
    ).sampling
    assert sampling.response_format.type == "json_schema"
    assert json.loads(sampling.response_format.json_schema) == SCHEMA
    [tool] = sampling.tools
    assert (tool.name, tool.description) == ("get_weather", "The weather in a city.")
    assert json.loads(tool.parameters) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert (sampling.tool_choice.mode, sampling.tool_choice.function) == ("function", "get_weather")
    assert sampling.HasField("parallel_tool_calls") and not sampling.parallel_tool_calls
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 3)


def test_the_short_forms() -> None:
    assert request(response_format={"type": "json_object"}).sampling.response_format.type == (
        "json_object"
    )
    sampling = request(json_schema=SCHEMA, tools=[], tool_choice="required").sampling
    assert sampling.response_format.type == "json_schema"
    assert json.loads(sampling.response_format.json_schema) == SCHEMA
    assert (sampling.tool_choice.mode, sampling.tool_choice.function) == ("required", "")
    bare = {"type": "function", "function": {"name": "now"}}
    assert request(tools=[bare]).sampling.tools[0].parameters == ""  # any object


@pytest.mark.parametrize(
    ("structure", "named"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_object"}, "json_schema": SCHEMA}, "json_schema"),
        ({"json_schema": ["not", "a", "schema"]}, "json_schema"),
        ({"tools": WEATHER}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [WEATHER, {"type": "function", "function": {}}]}, "tools[1]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].parameters",
        ),
        ({"tool_choice": "function"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
    ],
)
def test_a_malformed_shape_raises_value_error_naming_the_argument(
    structure: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(named)):
        request(**structure)


def test_messages_carry_earlier_calls_and_the_answers_to_them() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ChatMessage("assistant", "", tool_calls=(ToolCall("call_2", "now", "{}"),)),
        ChatMessage("tool", "noon", tool_call_id="call_2"),
        ("user", "And tomorrow?"),
    ]
    sent = request(messages).messages
    assert [(m.role, m.content, m.tool_call_id) for m in sent] == [
        ("user", "Weather in Paris?", ""),
        ("assistant", "", ""),
        ("tool", "sunny", "call_1"),
        ("assistant", "", ""),
        ("tool", "noon", "call_2"),
        ("user", "And tomorrow?", ""),
    ]
    calls = [(c.id, c.name, c.arguments) for m in sent for c in m.tool_calls]
    assert calls == [("call_1", "get_weather", '{"city": "Paris"}'), ("call_2", "now", "{}")]


def test_a_call_s_arguments_may_be_a_dict() -> None:
    call = {"id": "c", "function": {"name": "f", "arguments": {"x": 1}}}
    [message] = request([{"role": "assistant", "tool_calls": [call]}]).messages
    assert json.loads(message.tool_calls[0].arguments) == {"x": 1}


@pytest.mark.parametrize(
    ("message", "named"),
    [
        ({"role": "user", "content": ["parts"]}, "messages[0]"),
        ({"role": "assistant", "tool_calls": {"id": "c"}}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[0].tool_calls[0]"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_a_malformed_message_raises_value_error_naming_it(
    message: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(named)):
        request([message])


def test_streaming_events_carry_their_tokens_logprobs() -> None:
    asked = events_pb2.GenerateRequest(
        model="tiny", sampling=events_pb2.SamplingParams(logprobs=True, top_logprobs=2)
    )
    streaming = [convert.event_of(e) for e in script("r1", ("a", "b"), request=asked)][2:4]
    assert [e.logprobs for e in streaming] == [
        (TokenLogprob(10, -0.5, (TopLogprob(10, -0.5), TopLogprob(11, -1.0))),),
        (TokenLogprob(11, -0.5, (TopLogprob(11, -0.5), TopLogprob(12, -1.0))),),
    ]
    plain = convert.event_of(script("r1", ("a",))[2])
    assert plain.logprobs == ()
    assert convert.token_logprob_of(logprob_of(7, 0)) == TokenLogprob(7, -0.5)


def test_calls_are_read_back_from_an_answer_with_the_gateway_s_ids() -> None:
    text = (
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now"}]}'
    )
    calls = tool_calls_of(text, "run-1")
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert calls[0].id.startswith("call_") and len({c.id for c in calls}) == 2
    assert tool_calls_of(text, "run-1") == calls  # the same run names the same ids
    assert tool_calls_of(text, "run-2") != calls


HERMES = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


@pytest.mark.parametrize(
    "text",
    [
        HERMES,
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now"}]}',
    ],
)
def test_hermes_blocks_are_read_as_the_generic_object_is(text: str) -> None:
    calls = tool_calls_of(text, "run-1")
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    # The same ids as for the same calls in the generic format.
    generic = '{"tool_calls": [{"name": "get_weather", "arguments": {}}, {"name": "now"}]}'
    assert [c.id for c in calls] == [c.id for c in tool_calls_of(generic, "run-1") or ()]


def test_a_llama3_object_is_one_call() -> None:
    calls = tool_calls_of(' {"name": "get_weather", "parameters": {"city": "Paris"}}\n', "run-1")
    assert calls is not None and len(calls) == 1
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("get_weather", {"city": "Paris"})
    assert calls[0] == (tool_calls_of(HERMES, "run-1") or ())[0]


@pytest.mark.parametrize(
    "text",
    [
        "Sunny.",
        '{"answer": 4}',
        '{"tool_calls": []}',
        '{"tool_calls": [{"arguments": {}}]}',
        "{",
        # hermes: each block whole, holding a named call, and nothing else
        '<tool_call>\n{"name": "now", "arguments": {}}',
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "now"}\n</tool_call> and then some text',
        'First: <tool_call>\n{"name": "now"}\n</tool_call>',
        # llama3: only the whole answer, with nothing besides name and parameters
        '{"name": "now", "parameters": {}, "extra": 1}',
        '{"name": 4, "parameters": {}}',
        '[{"name": "now", "parameters": {}}]',
    ],
)
def test_text_is_not_calls(text: str) -> None:
    assert tool_calls_of(text, "run-1") is None


@pytest.mark.parametrize(
    ("text", "may_be_calls"),
    [
        ("", True),
        ("  ", True),
        ('{"tool', True),
        ("<", True),
        (" <tool_c", True),
        ("<tool_call>\n{", True),
        ("Sunny", False),
        ("<b>", False),
        ("<tool_cal!", False),
    ],
)
def test_an_answer_may_open_calls_until_it_cannot(text: str, may_be_calls: bool) -> None:
    assert may_open_calls(text) is may_be_calls
