"""OpenAI-style bodies into admission's parameters, and run events and API errors into
OpenAI-style answers: the pure halves of the HTTP front door."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from services.admission.http.requests import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_params,
    completion_params,
    param_names,
)
from services.admission.http.responses import Completion, http_error, sse_frame
from services.admission.requests import Limits, field_violations
from services.core.errors import (
    FieldViolation,
    IdempotencyKeyReused,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    Unavailable,
)
from services.core.runs import RunState, StoredEvent

LIMITS = Limits(max_tokens=4096, default_disconnect_grace=30.0)
CHAT = [{"role": "user", "content": "hi"}]


def chat(headers: dict[str, str] | None = None, **fields: Any) -> Any:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **fields})
    return chat_params(body, headers or {}, LIMITS)


def refused_param(call: Any) -> str | None:
    with pytest.raises(InvalidArgument) as refused:
        call()
    return refused.value.violations[0].field


def test_chat_fields_become_sampling_and_headers_become_key_and_grace() -> None:
    params = chat(
        {"idempotency-key": "k1", "x-tollgate-disconnect-grace": "2.5"},
        max_tokens=9,
        temperature=0,
        top_p=0.5,
        stop="END",
        seed=7,
        top_k=3,
        ignore_eos=True,
        user="someone",
        unknown_field={"ignored": True},
    )
    assert [m[:2] for m in params.messages] == [("user", "hi")]
    assert params.sampling.max_tokens == 9 and params.sampling.temperature == 0
    assert params.sampling.stop == ("END",) and params.sampling.seed == 7
    assert params.sampling.top_k == 3 and params.sampling.ignore_eos
    assert params.idempotency_key == "k1" and params.disconnect_grace == 2.5
    assert params.until_terminal


def test_max_completion_tokens_wins_and_an_unset_one_has_a_default() -> None:
    assert chat(max_tokens=5, max_completion_tokens=6).sampling.max_tokens == 6
    assert chat().sampling.max_tokens == DEFAULT_MAX_TOKENS
    assert chat().disconnect_grace == LIMITS.default_disconnect_grace


def test_text_parts_are_joined_and_developer_is_system() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    params = chat(messages=[{"role": "developer", "content": parts}])
    assert [m[:2] for m in params.messages] == [("system", "ab")]
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert refused_param(lambda: chat(messages=[{"role": "user", "content": image}])) == (
        "messages[0].content"
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools[0].type"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
            "messages[0].tool_calls[0].function",
        ),
        ({"logit_bias": {"the": 2.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 2.0}}, "logit_bias"),
        ({"seed": -1}, "seed"),
        ({"messages": []}, "messages"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    assert refused_param(lambda: chat(**fields)) == param


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    params = chat(
        n=1, logprobs=False, tools=[], tool_choice="none", response_format={"type": "text"}
    )
    assert not params.sampling.structure.constrained and not params.sampling.logprobs
    chat(presence_penalty=0, frequency_penalty=0.0, logit_bias={})


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_response_format_and_tools_become_the_structure_and_its_stored_form() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    formatted = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert formatted.sampling.structure.response_format == "json_schema"
    assert json.loads(formatted.sampling.structure.json_schema) == schema
    stored = formatted.sampling.payload()["response_format"]
    assert stored["type"] == "json_schema" and json.loads(stored["json_schema"]) == schema
    assert chat(response_format={"type": "json_object"}).sampling.structure.constraint() == (
        '{"type": "object"}',
        "",
    )
    tools = chat(
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    ).sampling
    structure = tools.structure
    assert [t.name for t in structure.tools] == ["get_weather"]
    assert (structure.tool_choice, structure.function) == ("function", "get_weather")
    assert not structure.parallel_tool_calls and structure.calls_tools
    payload = tools.payload()
    assert payload["tool_choice"] == {"mode": "function", "function": "get_weather"}
    assert payload["tools"][0]["name"] == "get_weather" and payload["parallel_tool_calls"] is False
    assert chat(tools=[WEATHER]).sampling.structure.tool_choice == "auto"
    assert not chat(tools=[WEATHER], tool_choice="none").sampling.structure.calls_tools


def test_what_the_structure_says_is_checked_and_named_as_openai_names_it() -> None:
    bad_name = {"type": "function", "function": {"name": "no spaces", "parameters": {}}}
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [bad_name]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
    ]
    for fields, param in cases:
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT, **fields})
        found = field_violations(chat_params(body, {}, LIMITS), ["m"], LIMITS)
        assert [param_names(body)[v.field] for v in found] == [param], fields


def test_an_assistants_calls_and_a_tools_answer_are_turns_of_the_conversation() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    params = chat(
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[WEATHER],
    )
    assistant, tool = params.messages[1], params.messages[2]
    assert assistant.tool_calls[0].name == "get_weather"
    assert json.loads(assistant.tool_calls[0].arguments) == {"city": "Oslo"}
    assert (tool.role, tool.content, tool.tool_call_id) == ("tool", "sunny", "call_1")
    # A plain conversation hashes as it always has.
    plain = chat()
    assert plain.messages[0].canonical() == ["user", "hi"]


def test_logprobs_become_sampling_on_both_endpoints() -> None:
    sampling = chat(logprobs=True, top_logprobs=3).sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 3)
    assert sampling.payload()["top_logprobs"] == 3
    body = CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 2})
    sampling = completion_params(body, {}, LIMITS).sampling
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 2)
    body = CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 0})
    assert completion_params(body, {}, LIMITS).sampling.logprobs
    body = CompletionRequest.model_validate({"model": "m", "prompt": "p", "logprobs": 6})
    assert refused_param(lambda: completion_params(body, {}, LIMITS)) == "logprobs"


def test_penalties_and_biases_become_sampling_and_out_of_range_ones_are_named() -> None:
    params = chat(
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        repetition_penalty=1.2,
        min_p=0.05,
        logit_bias={"42": -100, "7": 3.5},
    )
    sampling = params.sampling
    assert (sampling.frequency_penalty, sampling.presence_penalty) == (0.5, -0.25)
    assert (sampling.repetition_penalty, sampling.min_p) == (1.2, 0.05)
    assert sampling.logit_bias == ((7, 3.5), (42, -100.0))
    assert sampling.payload()["logit_bias"] == {"7": 3.5, "42": -100.0}
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": CHAT})
    names = param_names(body)
    for fields, param in (
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ):
        found = field_violations(chat(**fields), ["m"], LIMITS)
        assert [names[v.field] for v in found] == [param], fields


def test_a_malformed_grace_header_is_refused_by_name() -> None:
    assert refused_param(lambda: chat({"x-tollgate-disconnect-grace": "soon"})) == (
        "x-tollgate-disconnect-grace"
    )


def test_completion_prompts() -> None:
    def complete(**fields: Any) -> Any:
        body = CompletionRequest.model_validate({"model": "m", **fields})
        return completion_params(body, {}, LIMITS)

    assert complete(prompt="once").prompt == "once"
    assert complete(prompt=["once"]).prompt == "once"
    assert refused_param(lambda: complete(prompt=["a", "b"])) == "prompt"
    echoed = complete(prompt="a", echo=True, logprobs=2).sampling
    assert echoed.prompt_logprobs and echoed.top_logprobs == 2
    assert echoed.payload()["prompt_logprobs"] is True
    assert not complete(prompt="a", echo=True).sampling.prompt_logprobs
    assert refused_param(lambda: complete(prompt="a", best_of=2)) == "best_of"
    assert refused_param(lambda: complete(prompt="a", logprobs=9)) == "logprobs"


def test_json_infinities_are_refused_by_the_body_model() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate_json(
            '{"model": "m", "messages": [], "temperature": 1e999}'
        )


def test_validation_paths_are_named_as_openai_names_them() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CHAT, "max_completion_tokens": 0}
    )
    params = chat_params(body, {}, LIMITS)
    refused = InvalidArgument(field_violations(params, ["m"], LIMITS))
    answer = http_error(refused, param_names(body))
    assert answer.status == 400
    assert answer.body["error"]["param"] == "max_completion_tokens"
    assert answer.body["error"]["message"].startswith("max_completion_tokens: ")


@pytest.mark.parametrize(
    ("error", "status", "headers"),
    [
        (InvalidArgument([FieldViolation("model", "unknown")]), 400, {}),
        (NotFound("run 'x' not found"), 404, {}),
        (IdempotencyKeyReused("run_1"), 409, {"x-request-id": "run_1"}),
        (QuotaExceeded("over", "tenant:t", retry_after=0.2), 429, {"retry-after": "1"}),
        (Unavailable("queue full", retry_after=2.5), 503, {"retry-after": "3"}),
    ],
)
def test_api_errors_map_to_http_statuses(
    error: Exception, status: int, headers: dict[str, str]
) -> None:
    answer = http_error(error)  # type: ignore[arg-type]
    assert answer.status == status and answer.headers == headers
    assert set(answer.body["error"]) == {"message", "type", "param", "code"}


def test_an_internal_error_tells_nothing() -> None:
    from services.core.errors import ApiError

    answer = http_error(ApiError("SELECT secret FROM keys failed"))
    assert answer.status == 500 and answer.body["error"]["message"] == "internal error"


def event(seq: int, kind: RunState, **payload: Any) -> StoredEvent:
    return StoredEvent("run_1", seq, kind, "ten_1", payload, datetime(2026, 1, 1, tzinfo=UTC))


RUN = [
    event(1, RunState.QUEUED),
    event(2, RunState.PREFILL),
    event(3, RunState.STREAMING, text="Hel", token_ids=[1, 2]),
    event(4, RunState.STREAMING, text="", token_ids=[3]),  # an unfinished character
    event(5, RunState.STREAMING, text="lo", token_ids=[4]),
    event(
        6,
        RunState.COMPLETED,
        finish_reason="stop_sequence",
        usage={"prompt_tokens": 4, "cached_prompt_tokens": 2, "output_tokens": 4},
    ),
]


def frames_of(completion: Completion) -> list[tuple[str | None, Any]]:
    found = []
    for stored in RUN:
        for frame in completion.frames(stored):
            lines = dict(line.split(": ", 1) for line in frame.decode().strip().split("\n"))
            data = lines["data"]
            found.append((lines.get("id"), data if data == "[DONE]" else json.loads(data)))
    return found


def test_a_chat_stream_opens_with_the_role_and_each_frame_carries_its_event_seq() -> None:
    frames = frames_of(Completion(True, "run_1", "m", include_usage=True))
    assert [seq for seq, _ in frames] == ["1", "3", "4", "5", "6", "6", None]
    assert frames[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(f[1]["choices"][0]["delta"].get("content", "") for f in frames[:4]) == "Hello"
    assert frames[4][1]["choices"][0]["finish_reason"] == "stop"
    usage = frames[5][1]["usage"]
    assert frames[5][1]["choices"] == [] and usage["total_tokens"] == 8
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2}
    assert frames[-1][1] == "[DONE]"


def test_a_text_stream_without_usage_and_the_whole_body() -> None:
    completion = Completion(False, "run_1", "m")
    frames = frames_of(completion)
    assert [seq for seq, _ in frames] == ["3", "4", "5", "6", None]
    assert frames[0][1]["object"] == "text_completion" and frames[0][1]["choices"][0]["text"]
    body = completion.body()
    assert body["choices"][0]["text"] == "Hello" and body["usage"]["completion_tokens"] == 4
    assert body["created"] == int(datetime(2026, 1, 1, tzinfo=UTC).timestamp())


CALL_TEXT = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'


def run_saying(*texts: str, finish_reason: str = "stop", **streaming: Any) -> list[StoredEvent]:
    said = [
        event(3 + i, RunState.STREAMING, text=text, token_ids=[i], **streaming)
        for i, text in enumerate(texts)
    ]
    usage = {"prompt_tokens": 4, "output_tokens": len(texts)}
    done = event(3 + len(texts), RunState.COMPLETED, finish_reason=finish_reason, usage=usage)
    return [event(1, RunState.QUEUED), *said, done]


def rendered(completion: Completion, events: list[StoredEvent]) -> list[dict[str, Any]]:
    chunks = []
    for stored in events:
        for frame in completion.frames(stored):
            data = frame.decode().strip().split("data: ", 1)[1]
            if data != "[DONE]":
                chunks.append(json.loads(data))
    return chunks


def test_a_call_is_held_back_and_streamed_as_tool_calls() -> None:
    run = run_saying(" ", CALL_TEXT[:20], CALL_TEXT[20:])
    chunks = rendered(Completion(True, "run_1", "m", tools=True), run)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any(d.get("content") for d in deltas)
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = Completion(True, "run_1", "m", tools=True)
    for stored in run:
        whole.add(stored)
    message = whole.body()["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["id"] == calls[0]["id"]
    assert whole.body()["choices"][0]["finish_reason"] == "tool_calls"


def test_with_tools_a_text_answer_streams_as_text_and_a_cut_call_stays_text() -> None:
    chunks = rendered(Completion(True, "run_1", "m", tools=True), run_saying("Sun", "ny"))
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == ["Sun", "ny"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    cut = run_saying(CALL_TEXT[:30], finish_reason="length")
    chunks = rendered(Completion(True, "run_1", "m", tools=True), cut)
    assert chunks[1]["choices"][0]["delta"]["content"] == CALL_TEXT[:30]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_go_with_their_text_in_openais_shapes() -> None:
    pieces = {1: b"Hel", 2: b"lo", 3: b"\xe6"}
    entry = {
        "token_id": 1,
        "logprob": -0.5,
        "top": [{"token_id": 1, "logprob": -0.5}, {"token_id": 3}],
    }
    run = run_saying("Hel", logprobs=[entry])
    chat_chunks = rendered(Completion(True, "run_1", "m", token_bytes=pieces.__getitem__), run)
    (content,) = chat_chunks[1]["choices"][0]["logprobs"]["content"]
    assert (content["token"], content["logprob"], content["bytes"]) == ("Hel", -0.5, [72, 101, 108])
    assert [t["logprob"] for t in content["top_logprobs"]] == [-0.5, 0.0]
    assert content["top_logprobs"][1]["bytes"] == [0xE6]
    text = Completion(False, "run_1", "m", token_bytes=pieces.__getitem__)
    for stored in run:
        text.add(stored)
    logprobs = text.body()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["Hel"] and logprobs["token_logprobs"] == [-0.5]
    assert logprobs["text_offset"] == [0] and logprobs["top_logprobs"][0]["Hel"] == -0.5


def test_echo_puts_the_prompt_and_its_logprobs_before_the_answer() -> None:
    pieces = {7: b"Say", 8: b" hi", 1: b"Hel"}
    scored = [{"token_id": 8, "logprob": -2.0, "top": [{"token_id": 1, "logprob": -1.0}]}]
    said = {"token_id": 1, "logprob": -0.5}
    queued = event(1, RunState.QUEUED, prompt_token_ids=[7, 8])
    run = [queued, *run_saying("Hel", logprobs=[said], prompt_logprobs=scored)[1:]]
    whole = Completion(False, "run_1", "m", token_bytes=pieces.__getitem__, echo="Say hi")
    for stored in run:
        whole.add(stored)
    (choice,) = whole.body()["choices"]
    assert choice["text"] == "Say hiHel"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["Say", " hi", "Hel"]
    assert logprobs["token_logprobs"] == [None, -2.0, -0.5]
    assert logprobs["top_logprobs"] == [None, {"Hel": -1.0}, {}]
    assert logprobs["text_offset"] == [0, 3, 6]
    streamed = Completion(False, "run_1", "m", token_bytes=pieces.__getitem__, echo="Say hi")
    (first, *_) = rendered(streamed, run)
    assert first["choices"][0]["text"] == "Say hiHel"
    assert first["choices"][0]["logprobs"]["token_logprobs"] == [None, -2.0, -0.5]
    plain = Completion(False, "run_1", "m", echo="Say hi")
    assert rendered(plain, run_saying("Hel"))[0]["choices"][0]["text"] == "Say hiHel"
    plain = Completion(True, "run_1", "m")
    assert rendered(plain, run)[1]["choices"][0]["logprobs"] is None


def test_n_choices_stream_by_index_and_each_ends_when_its_answer_does() -> None:
    assert chat(n=3).sampling.n == 3 and chat(n=3).sampling.payload()["n"] == 3
    assert "n" not in chat(n=1).sampling.payload()
    run = [
        event(1, RunState.QUEUED),
        event(3, RunState.STREAMING, text="Hi", token_ids=[1], index=1),
        event(4, RunState.STREAMING, text="Yo", token_ids=[2], finish_reason="stop"),
        event(5, RunState.STREAMING, text="!", token_ids=[3], index=1, finish_reason="length"),
        event(6, RunState.COMPLETED, finish_reason="length", usage={"output_tokens": 3}),
    ]
    chunks = rendered(Completion(True, "run_1", "m", n=2), run)
    opened = [c["choices"][0]["index"] for c in chunks[:2]]
    assert opened == [0, 1] and all(c["choices"][0]["delta"]["role"] for c in chunks[:2])
    said = {0: "", 1: ""}
    ends = {}
    for chunk in chunks[2:]:
        choice = chunk["choices"][0]
        said[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            ends[choice["index"]] = choice["finish_reason"]
    assert said == {0: "Yo", 1: "Hi!"} and ends == {0: "stop", 1: "length"}
    whole = Completion(False, "run_1", "m", n=2)
    for stored in run:
        whole.add(stored)
    choices = whole.body()["choices"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in choices] == [
        (0, "Yo", "stop"),
        (1, "Hi!", "length"),
    ]


def test_a_failed_run_ends_the_stream_with_an_error_frame() -> None:
    completion = Completion(True, "run_1", "m")
    failed = event(3, RunState.FAILED, code="WORKER_LOST", message="worker gone")
    frames = completion.frames(failed)
    body = json.loads(frames[0].decode().split("data: ", 1)[1])
    assert body["error"]["code"] == "WORKER_LOST" and frames[-1] == b"data: [DONE]\n\n"
    assert frames[0].startswith(b"id: 3\n")


def test_sse_frames_escape_newlines_in_text() -> None:
    frame = sse_frame({"text": "a\n\nb"}, 7)
    assert frame.count(b"\n\n") == 1 and frame.endswith(b"\n\n")
