"""Structured outputs, tools and logprobs through the clients applications use: the
official `openai` SDK and LangChain's `ChatOpenAI`, unchanged, against a running stack.

The stack serves a tiny model with random weights and a small vocabulary: what it says is
noise, spelled in many tokens, so every answer here is checked for its form (it parses,
it validates, its calls name a tool), which constrained decoding guarantees whatever the
weights.
"""

from __future__ import annotations

import json
import math
import urllib.request
from typing import Any, Literal

import jsonschema
import openai
import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.e2e.conftest import Stack

# Real clients against real processes, with LangChain's import: with the slow cases.
pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the weather in Oslo?"}]
CITY = {"type": "string", "enum": ["Oslo", "Paris", "Lima"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


class Forecast(BaseModel):
    city: Literal["Oslo", "Paris", "Lima"]
    celsius: int = Field(ge=-40, le=50)
    sunny: bool
    note: str = Field(max_length=12)


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.tenant_key("openai-params")


@pytest.fixture(scope="module")
def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=0)


def test_parse_returns_the_pydantic_model(sdk: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        answer = sdk.chat.completions.parse(
            model="tiny",
            messages=CHAT,  # type: ignore[arg-type]
            response_format=Forecast,
            max_tokens=120,
            temperature=temperature,
            seed=3,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Forecast)


def test_json_object_mode_answers_a_json_object(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model="tiny",
        messages=CHAT,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=48,
        temperature=0,
    )
    choice = answer.choices[0]
    if choice.finish_reason == "stop":  # a random model may still be inside the object
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:
        assert choice.finish_reason == "length" and (choice.message.content or "").startswith("{")


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_response_format(
    sdk: openai.OpenAI,
) -> None:
    broken = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(
            model="tiny",
            messages=CHAT,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": broken}},
        )
    assert refused.value.param == "response_format.json_schema"  # type: ignore[attr-defined]
    assert "missing" in refused.value.message


def test_a_required_call_names_a_tool_and_its_arguments_validate(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model="tiny",
        messages=CHAT,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=160,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    # The conversation goes on with the call and the tool's answer.
    follow_up = sdk.chat.completions.create(
        model="tiny",
        messages=[
            *CHAT,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."},
        ],  # type: ignore[list-item]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=8,
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length")


def test_streamed_calls_arrive_as_tool_call_deltas(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model="tiny",
        messages=CHAT,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            if delta.function and delta.function.name:
                names[delta.index] = delta.function.name
            if delta.function and delta.function.arguments:
                arguments[delta.index] = arguments.get(delta.index, "") + delta.function.arguments
        finish = choice.finish_reason or finish
    if finish == "length":  # a random model may list calls until the tokens run out
        return
    assert finish == "tool_calls" and names
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}  # type: ignore[index]
    for index, name in names.items():
        jsonschema.validate(json.loads(arguments[index]), tools[name])


def test_logprobs_are_the_tokens_and_their_alternatives(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(
        model="tiny",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None and answer.usage is not None
    content = choice.logprobs.content or []
    assert len(content) == answer.usage.completion_tokens == 6
    assert "".join(bytes(t.bytes or []).decode(errors="replace") for t in content).startswith(
        choice.message.content or ""
    )
    for token in content:
        values = [t.logprob for t in token.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        # Greedy: the chosen token is the likeliest.
        assert math.isclose(token.logprob, values[0], abs_tol=1e-5) and token.logprob <= 0
    streamed = sdk.completions.create(
        model="tiny", prompt="Once upon", max_tokens=4, temperature=0, logprobs=2, stream=True
    )
    tokens = []
    for chunk in streamed:
        logprobs = chunk.choices[0].logprobs if chunk.choices else None
        if logprobs is not None:
            tokens += logprobs.tokens or []
            assert all(len(top) == 2 for top in logprobs.top_logprobs or [])
    assert 1 <= len(tokens) <= 4


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(
    stack: Stack, key: str, sdk: openai.OpenAI
) -> None:
    """A loglikelihood request as lm-evaluation-harness sends it: echo, logprobs, greedy."""
    prompt = "Once upon a time"
    answer = sdk.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    (choice,) = answer.choices
    assert answer.usage is not None and choice.logprobs is not None
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    tokens = choice.logprobs.tokens or []
    values = choice.logprobs.token_logprobs or []
    assert len(tokens) == len(values) == answer.usage.total_tokens
    # The prompt's tokens as the model reads it: with the BOS the tokenizer adds.
    assert "".join(tokens).endswith(choice.text)
    assert values[0] is None and all(v is not None and v <= 0 for v in values[1:])
    tops = choice.logprobs.top_logprobs or []
    assert tops[0] is None and all(len(top) == 1 for top in tops[1:])
    streamed = sdk.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    # The SDK's prompt_logprobs: the same scores on the first streaming event.
    with stack.client(key) as client:
        events = list(
            client.generate(prompt, model="tiny", max_tokens=1, temperature=0, prompt_logprobs=True)
        )
    (first, *_) = [e for e in events if e.kind == "streaming"]
    scored = [e.logprob for e in first.prompt_logprobs]
    assert scored == pytest.approx(values[1:-1], abs=1e-5)  # the last is the answer's


def test_n_answers_draw_apart_share_the_prompt_and_bill_it_once(
    stack: Stack, key: str, sdk: openai.OpenAI
) -> None:
    options: dict[str, Any] = dict(
        model="tiny", messages=CHAT, max_tokens=5, seed=5, extra_body={"ignore_eos": True}
    )
    one = sdk.chat.completions.create(n=1, **options)
    raw = sdk.chat.completions.with_raw_response.create(n=3, **options)
    answer = raw.parse()
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.finish_reason for c in answer.choices] == ["length"] * 3
    assert answer.choices[0].message.content == one.choices[0].message.content  # seed + 0
    assert len({c.message.content for c in answer.choices}) > 1
    assert answer.usage is not None and one.usage is not None
    assert answer.usage.prompt_tokens == one.usage.prompt_tokens
    assert answer.usage.completion_tokens == 15
    billed = _billed_entries(stack, key, raw.headers["x-request-id"])
    assert billed["input_tokens"] + billed.get("cached_input_tokens", 0) == one.usage.prompt_tokens
    assert billed["output_tokens"] == 15
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    ends: dict[int, str] = {}
    for chunk in sdk.chat.completions.create(n=3, stream=True, **options):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                ends[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in answer.choices}
    assert ends == {0: "length", 1: "length", 2: "length"}


def _billed_entries(stack: Stack, key: str, run_id: str) -> dict[str, int]:
    """The quantities the run's `billed` event charged, by billing type."""
    request = urllib.request.Request(
        f"{stack.http}/v1/runs/{run_id}/events", headers={"authorization": f"Bearer {key}"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("data: ") and '"billed"' in line:
                entries = json.loads(line[6:])["billed"]["entries"]
                return {e["billing_type"]: int(e["quantity"]) for e in entries}
    raise AssertionError("the run was never billed")


def test_langchain_binds_tools_and_structures_output(stack: Stack) -> None:
    model = ChatOpenAI(
        model="tiny",
        base_url=f"{stack.http}/v1",
        api_key=stack.tenant_key("langchain"),  # type: ignore[arg-type]
        temperature=0,
        max_tokens=200,  # type: ignore[call-arg]
        max_retries=0,
    )

    @tool
    def get_weather(city: Literal["Oslo", "Paris", "Lima"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    # strict, as OpenAI's strict mode has it: no arguments but the function's, which a
    # random model would otherwise add.
    called = model.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke(
        [HumanMessage("What is the weather in Oslo?")]
    )
    (call,) = called.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Oslo", "Paris", "Lima")
    structured = model.with_structured_output(Forecast, strict=True).invoke(
        "The forecast for Lima?"
    )
    assert isinstance(structured, Forecast)
