"""Anthropic's Messages API through the official `anthropic` SDK, unchanged, against a
running stack: answers, streams, token counts, tools, and each error the stack can give
from outside as the SDK's own exception class.

The stack serves a tiny model with random weights: what it says is noise, so answers are
checked for their form, which constrained decoding guarantees whatever the weights.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message

from tests.e2e.conftest import Stack

# Real clients against real processes: with the slow cases.
pytestmark = pytest.mark.slow

USER: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
# The SDK no longer takes sampling fields as arguments; the API still does.
GREEDY = {"temperature": 0, "top_k": 5}
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Oslo", "Paris", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


# A call of get_weather, greedy, with room for its arguments.
FORCED: dict[str, Any] = {
    "tools": [WEATHER],
    "tool_choice": {"type": "tool", "name": "get_weather"},
    "max_tokens": 160,
    "extra_body": GREEDY,
}


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.tenant_key("anthropic")


@pytest.fixture(scope="module")
def sdk(stack: Stack, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.http, api_key=key, max_retries=0)


def test_create_answers_a_message(sdk: anthropic.Anthropic) -> None:
    message = sdk.messages.create(
        model="tiny",
        system="Answer briefly.",
        messages=USER,
        max_tokens=5,
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0},
    )
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 5
    assert all(block.type == "text" for block in message.content)


def test_a_bearer_key_works_as_x_api_key_does(stack: Stack, key: str) -> None:
    bearer = anthropic.Anthropic(base_url=stack.http, auth_token=key, max_retries=0)
    message = bearer.messages.create(model="tiny", messages=USER, max_tokens=2)
    assert message.usage.output_tokens <= 2


def test_stream_gives_the_text_and_the_final_message(sdk: anthropic.Anthropic) -> None:
    with sdk.messages.stream(
        model="tiny", messages=USER, max_tokens=6, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert final.usage.output_tokens > 0
    # Greedy, so the whole answer is the same.
    whole = sdk.messages.create(model="tiny", messages=USER, max_tokens=6, extra_body=GREEDY)
    assert "".join(b.text for b in whole.content if b.type == "text") == text


def test_count_tokens_counts_the_prompt_and_its_tools(sdk: anthropic.Anthropic) -> None:
    plain = sdk.messages.count_tokens(model="tiny", messages=USER)
    with_tools = sdk.messages.count_tokens(model="tiny", messages=USER, tools=[WEATHER])
    assert 0 < plain.input_tokens < with_tools.input_tokens
    message = sdk.messages.create(model="tiny", messages=USER, max_tokens=1)
    assert message.usage.input_tokens == plain.input_tokens


def test_a_forced_tool_call_validates_and_the_conversation_goes_on(
    sdk: anthropic.Anthropic,
) -> None:
    message = sdk.messages.create(model="tiny", messages=USER, **FORCED)
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    follow_up = sdk.messages.create(
        model="tiny",
        messages=[
            *USER,
            {"role": "assistant", "content": [call.model_dump()]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21."}
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "none"},
        max_tokens=4,
    )
    assert follow_up.stop_reason in ("end_turn", "max_tokens")


def test_a_streamed_tool_call_arrives_as_input_json(sdk: anthropic.Anthropic) -> None:
    with sdk.messages.stream(model="tiny", messages=USER, **FORCED) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (call,) = final.content
    assert call.type == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])


def events_of(answer: httpx.Response) -> list[dict[str, str]]:
    """Each SSE event's fields."""
    return [
        dict(line.split(": ", 1) for line in block.split("\n"))
        for block in answer.text.strip().split("\n\n")
    ]


def test_a_stream_asked_again_after_last_event_id_goes_on_with_exactly_the_tail(
    stack: Stack, key: str
) -> None:
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "Idempotency-Key": "resume-1"}
    body = {"model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 0, "stream": True}
    first = httpx.post(f"{stack.http}/v1/messages", json=body, headers=headers, timeout=60)
    events = events_of(first)
    assert [e["event"] for e in events][:3] == ["message_start", "content_block_start", "ping"]
    assert events[-1]["event"] == "message_stop"
    # The client has every event up to a text delta with text after it (or up to the start,
    # when the text came in one delta).
    deltas = [i for i, e in enumerate(events) if "id" in e and e["event"] == "content_block_delta"]
    cut = deltas[:-1][len(deltas[:-1]) // 2] if len(deltas) > 1 else 0
    again = httpx.post(
        f"{stack.http}/v1/messages",
        json=body,
        headers={**headers, "Last-Event-ID": events[cut]["id"]},
        timeout=60,
    )
    assert again.headers["x-request-id"] == first.headers["x-request-id"]
    tail = events_of(again)
    # The same text after the cut, each character once, though the first stream sent
    # some of it in pieces before it was stored, and the replay sends it as stored.
    assert delta_text(events[: cut + 1]) + delta_text(tail) == delta_text(events)
    assert delta_text(tail)
    assert [e for e in tail if e["event"] != "content_block_delta"] == [
        e for e in events[cut + 1 :] if e["event"] != "content_block_delta"
    ]


def delta_text(events: list[dict[str, str]]) -> str:
    deltas = (json.loads(e["data"]) for e in events if e["event"] == "content_block_delta")
    return "".join(delta["delta"].get("text", "") for delta in deltas)


def test_errors_raise_the_sdks_exception_classes(stack: Stack, sdk: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as missing:
        # The SDK itself will not send a request without max_tokens: its client does.
        sdk.post("/v1/messages", body={"model": "tiny", "messages": USER}, cast_to=Message)
    assert "max_tokens" in missing.value.message
    assert missing.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    stranger = anthropic.Anthropic(base_url=stack.http, api_key="tg_bad", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model="tiny", messages=USER, max_tokens=2)
    with pytest.raises(anthropic.NotFoundError) as unknown:
        sdk.messages.create(model="no-such-model", messages=USER, max_tokens=2)
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    huge = "a" * (4 * 1024 * 1024 + 1024)
    with pytest.raises(anthropic.RequestTooLargeError) as too_large:
        sdk.messages.create(
            model="tiny", messages=[{"role": "user", "content": huge}], max_tokens=2
        )
    assert too_large.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]


def test_a_quota_refusal_is_a_rate_limit_error_with_retry_after(stack: Stack) -> None:
    tenant = stack.admin.create_tenant(f"anthropic-quota-{uuid.uuid4().hex[:6]}")
    stack.admin.set_quota(tenant.tenant_id, max_kv_blocks=1)
    key = stack.admin.create_api_key(tenant.tenant_id).secret
    limited = anthropic.Anthropic(base_url=stack.http, api_key=key, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as refused:
        limited.messages.create(model="tiny", messages=USER, max_tokens=64)
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


def test_openai_paths_keep_openais_error_body(stack: Stack) -> None:
    answer = httpx.post(
        f"{stack.http}/v1/chat/completions",
        json={"model": "tiny", "messages": USER},
        headers={"x-api-key": "tg_bad"},
    )
    assert answer.status_code == 401
    assert json.loads(answer.text)["error"]["type"] == "authentication_error"
    assert "type" not in json.loads(answer.text)
