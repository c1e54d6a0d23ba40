"""Response formats and tools as the sampler's constraint, the generic tool prompt, and the
calls read back from an answer (engine/structure.py, pure)."""

from __future__ import annotations

import json

import llguidance
import pytest

from engine.structure import (
    FunctionTool,
    Structure,
    ToolCall,
    calls_text,
    json_value,
)
from engine.tokenizer import Tokenizer
from tollgate.structure import tool_calls_of

WEATHER = FunctionTool(
    "get_weather",
    "The weather in a city",
    json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    ),
)
TIME = FunctionTool("get_time")
CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
# JSON nested deeper than Python's stack: json.loads raises RecursionError on it.
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def lltokenizer(tiny_model_dir: str) -> llguidance.LLTokenizer:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    return llguidance.LLTokenizer(tokenizer.backend.to_str())


def accepts(lltokenizer: llguidance.LLTokenizer, structure: Structure, text: str) -> bool:
    """Whether the structure's constraint lets an answer say exactly `text`."""
    json_schema, grammar = structure.constraint()
    spec = (
        llguidance.LLMatcher.grammar_from_json_schema(json_schema)
        if json_schema
        else llguidance.LLMatcher.grammar_from_lark(grammar)
    )
    matcher = llguidance.LLMatcher(lltokenizer, spec)
    assert not matcher.is_error(), matcher.get_error()
    tokens = lltokenizer.tokenize_str(text)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


def test_free_text_has_no_constraint() -> None:
    assert Structure().constraint() == ("", "")
    assert not Structure(tools=(WEATHER,), tool_choice="none").constrained
    assert Structure(tools=(WEATHER,), tool_choice="none").system_prompt() == ""


def test_json_formats_are_schemas() -> None:
    assert Structure(response_format="json_object").constraint() == ('{"type": "object"}', "")
    schema = '{"type": "array"}'
    assert Structure("json_schema", schema).constraint() == (schema, "")


def test_auto_lets_the_answer_be_text_or_calls(lltokenizer: llguidance.LLTokenizer) -> None:
    auto = Structure(tools=(WEATHER, TIME))
    json_schema, grammar = auto.constraint()
    assert json_schema == "" and grammar.startswith("start: calls | text")
    assert accepts(lltokenizer, auto, "It is sunny.")
    assert accepts(lltokenizer, auto, CALL)
    assert not accepts(lltokenizer, auto, '{"weather": "sunny"}')
    assert not accepts(lltokenizer, auto, CALL.replace("get_weather", "get_rain"))
    # The arguments follow the function's parameters.
    assert not accepts(lltokenizer, auto, CALL.replace('"city"', '"town"'))


def test_required_and_named_calls_are_schemas(lltokenizer: llguidance.LLTokenizer) -> None:
    required = Structure(tools=(WEATHER, TIME), tool_choice="required")
    assert required.constraint()[1] == ""
    assert accepts(lltokenizer, required, CALL)
    assert not accepts(lltokenizer, required, "It is sunny.")
    two = '{"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]}'
    assert accepts(lltokenizer, required, two)
    single = Structure(tools=(WEATHER, TIME), tool_choice="required", parallel_tool_calls=False)
    assert not accepts(lltokenizer, single, two)
    named = Structure(tools=(WEATHER, TIME), tool_choice="function", function="get_time")
    assert accepts(lltokenizer, named, '{"tool_calls": [{"name": "get_time", "arguments": {}}]}')
    assert not accepts(lltokenizer, named, CALL)
    assert "get_weather" not in named.system_prompt()


def test_auto_with_a_json_format_is_calls_or_that_json(lltokenizer: llguidance.LLTokenizer) -> None:
    schema = json.dumps(
        {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    )
    both = Structure("json_schema", schema, tools=(WEATHER,))
    assert accepts(lltokenizer, both, '{"answer": "sunny"}')
    assert accepts(lltokenizer, both, CALL)
    assert not accepts(lltokenizer, both, "sunny")


def test_the_system_prompt_lists_the_tools_and_the_format() -> None:
    prompt = Structure(tools=(WEATHER,)).system_prompt()
    listed = json.loads(prompt.splitlines()[1])
    assert listed[0]["name"] == "get_weather" and listed[0]["parameters"]["required"] == ["city"]
    assert '{"tool_calls"' in prompt and "Otherwise answer in text." in prompt
    assert "Otherwise" not in Structure(tools=(WEATHER,), tool_choice="required").system_prompt()


def test_earlier_calls_are_written_as_the_model_writes_them() -> None:
    written = calls_text([ToolCall("call_1", "get_weather", '{"city": "Oslo"}')])
    assert json.loads(written) == json.loads(CALL)


@pytest.mark.parametrize(
    ("structure", "field"),
    [
        (Structure("yaml"), "response_format.type"),
        (Structure("json_schema"), "response_format.json_schema"),
        (Structure("json_schema", "{not json"), "response_format.json_schema"),
        (Structure("json_schema", "[1]"), "response_format.json_schema"),
        (Structure(tools=(FunctionTool("a b"),)), "tools[0].name"),
        (Structure(tools=(FunctionTool("f"), FunctionTool("f"))), "tools[1].name"),
        (Structure(tools=(FunctionTool("f", "", "nope"),)), "tools[0].parameters"),
        (Structure(tools=(FunctionTool("f"),) * 0, tool_choice="required"), "tool_choice.mode"),
        (
            Structure(tools=(FunctionTool("f"),), tool_choice="function", function="g"),
            "tool_choice.function",
        ),
        (Structure(tools=(FunctionTool("f"),), tool_choice="maybe"), "tool_choice.mode"),
        (Structure(tools=tuple(FunctionTool(f"f{i}") for i in range(129))), "tools"),
        (Structure("json_schema", DEEP), "response_format.json_schema"),
        (Structure(tools=(FunctionTool("f", "", DEEP),)), "tools[0].parameters"),
    ],
)
def test_malformed_parts_are_named(structure: Structure, field: str) -> None:
    assert [name for name, _ in structure.violations()] == [field]


def test_json_nested_past_python_s_stack_is_malformed_json() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        json_value(DEEP)
    assert Structure("json_schema", DEEP).violations()[0][1] == "is nested too deeply"
    # An earlier call's arguments the model could not have written stay as they were sent.
    written = json.loads(calls_text([ToolCall("call_1", "f", DEEP)]))
    assert written["tool_calls"][0]["arguments"] == DEEP
    assert tool_calls_of('{"tool_calls": ' + DEEP + "}", "run_1") is None
