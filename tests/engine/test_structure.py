"""Response formats and tools as the sampler's constraint, the tool formats (generic and the
chat templates' own), and the calls read back from an answer (engine/structure.py, pure).

The chat templates under tests/fixtures/chat_templates/ are the models' own, as their
tokenizer_config.json on Hugging Face has them: Qwen/Qwen2.5-7B-Instruct,
NousResearch/Hermes-3-Llama-3.1-8B (its "tool_use" template),
meta-llama/Llama-3.1-8B-Instruct and HuggingFaceTB/SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest

from engine.model_dirs.tiny import CHAT_TEMPLATE
from engine.structure import (
    FunctionTool,
    Structure,
    ToolCall,
    calls_text,
    json_value,
    template_calls,
    tool_format_of,
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
TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
HERMES_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


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
    assert not accepts(lltokenizer, auto, HERMES_CALL)
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
        (Structure(tool_format="xml"), "tool_format"),
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


@pytest.mark.parametrize(
    ("template", "tool_format"),
    [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
        ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", "generic"),
    ],
)
def test_a_chat_template_s_own_tool_format_is_found(template: str, tool_format: str) -> None:
    assert tool_format_of((TEMPLATES / template).read_text()) == tool_format


def test_a_template_without_tools_has_the_generic_format() -> None:
    assert tool_format_of(None) == tool_format_of("") == tool_format_of(CHAT_TEMPLATE) == "generic"
    # Naming `<tool_call>` is not enough: Qwen3-Coder's blocks hold XML, not JSON.
    xml = "{% if tools %}<tool_call>\n<function=name>\n<parameter=x>{% endif %}"
    assert tool_format_of(xml) == "generic"


def test_hermes_calls_are_tool_call_blocks(lltokenizer: llguidance.LLTokenizer) -> None:
    auto = Structure(tools=(WEATHER, TIME), tool_format="hermes")
    assert accepts(lltokenizer, auto, HERMES_CALL)
    assert accepts(lltokenizer, auto, f"{HERMES_CALL}\n{HERMES_TIME}")
    assert accepts(lltokenizer, auto, "It is sunny.")
    assert accepts(lltokenizer, auto, "<b>Sunny</b>")  # text may start with `<`
    assert not accepts(lltokenizer, auto, "<tool_call>\nsunny")  # but not open a call
    # Nor look like calls in another format.
    assert not accepts(lltokenizer, auto, CALL)
    assert not accepts(lltokenizer, auto, LLAMA3_CALL)
    assert not accepts(lltokenizer, auto, HERMES_CALL.replace("get_weather", "get_rain"))
    assert not accepts(lltokenizer, auto, HERMES_CALL.replace('"city"', '"town"'))
    assert not accepts(lltokenizer, auto, HERMES_CALL.replace("\n</tool_call>", "</tool_call>"))
    required = Structure(tools=(WEATHER, TIME), tool_choice="required", tool_format="hermes")
    assert accepts(lltokenizer, required, f"{HERMES_CALL}\n{HERMES_TIME}")
    assert not accepts(lltokenizer, required, "It is sunny.")
    single = Structure(
        tools=(WEATHER, TIME),
        tool_choice="required",
        parallel_tool_calls=False,
        tool_format="hermes",
    )
    assert accepts(lltokenizer, single, HERMES_TIME)
    assert not accepts(lltokenizer, single, f"{HERMES_CALL}\n{HERMES_TIME}")
    named = Structure(
        tools=(WEATHER, TIME), tool_choice="function", function="get_time", tool_format="hermes"
    )
    assert accepts(lltokenizer, named, HERMES_TIME)
    assert not accepts(lltokenizer, named, HERMES_CALL)
    both = Structure("json_object", tools=(WEATHER,), tool_format="hermes")
    assert accepts(lltokenizer, both, HERMES_CALL) and accepts(lltokenizer, both, '{"a": 1}')
    assert not accepts(lltokenizer, both, "sunny")


def test_a_llama3_call_is_one_object_with_parameters(lltokenizer: llguidance.LLTokenizer) -> None:
    auto = Structure(tools=(WEATHER, TIME), tool_format="llama3")
    assert accepts(lltokenizer, auto, LLAMA3_CALL)
    assert accepts(lltokenizer, auto, "It is sunny.")
    assert not accepts(lltokenizer, auto, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert not accepts(lltokenizer, auto, LLAMA3_CALL.replace('"city"', '"town"'))
    assert not accepts(lltokenizer, auto, CALL)
    assert not accepts(lltokenizer, auto, HERMES_CALL)
    # One call a turn, whatever parallel_tool_calls says.
    required = Structure(tools=(WEATHER, TIME), tool_choice="required", tool_format="llama3")
    assert required.constraint()[1] == ""
    assert accepts(lltokenizer, required, LLAMA3_CALL)
    assert not accepts(lltokenizer, required, "It is sunny.")
    assert not accepts(lltokenizer, required, f"[{LLAMA3_CALL}, {LLAMA3_CALL}]")
    both = Structure("json_object", tools=(WEATHER,), tool_format="llama3")
    assert accepts(lltokenizer, both, LLAMA3_CALL) and accepts(lltokenizer, both, '{"a": 1}')


def test_an_unchosen_format_is_the_generic_one() -> None:
    unchosen = Structure(tools=(WEATHER,), tool_format="")
    assert unchosen.violations() == []
    assert unchosen.constraint() == Structure(tools=(WEATHER,)).constraint()
    assert unchosen.system_prompt() == Structure(tools=(WEATHER,)).system_prompt()
    assert unchosen.template_tools() is None


@pytest.mark.parametrize("tool_format", ["hermes", "llama3"])
def test_a_template_format_gives_the_template_the_tools(tool_format: str) -> None:
    structure = Structure(tools=(WEATHER, TIME), tool_format=tool_format)
    assert structure.system_prompt() == ""
    tools = structure.template_tools()
    assert tools is not None
    assert [t["function"]["name"] for t in tools] == ["get_weather", "get_time"]
    assert tools[0]["type"] == "function"
    assert tools[0]["function"]["parameters"]["required"] == ["city"]
    assert tools[1]["function"]["parameters"] == {"type": "object"}
    named = Structure(
        tools=(WEATHER, TIME), tool_choice="function", function="get_time", tool_format=tool_format
    )
    assert [t["function"]["name"] for t in named.template_tools() or ()] == ["get_time"]
    not_called = Structure(tools=(WEATHER,), tool_choice="none", tool_format=tool_format)
    assert not_called.template_tools() is None
    assert Structure(tools=(WEATHER,)).template_tools() is None


def test_earlier_calls_are_written_in_each_format() -> None:
    calls = [ToolCall("call_1", "get_weather", '{"city": "Oslo"}')]
    assert calls_text(calls, "hermes") == HERMES_CALL
    assert calls_text(calls, "llama3") == LLAMA3_CALL
    assert calls_text(calls, "generic") == calls_text(calls)
    assert template_calls(calls) == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
        }
    ]


@pytest.mark.parametrize("text", [HERMES_CALL, f"{HERMES_CALL}\n{HERMES_TIME}", LLAMA3_CALL])
def test_what_a_template_format_allows_is_read_back_as_calls(text: str) -> None:
    calls = tool_calls_of(text, "run_1")
    assert calls is not None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


@pytest.mark.parametrize(
    "template",
    [
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
    ],
)
def test_a_template_renders_the_tools_and_calls_as_transformers_does(
    tiny_model_dir: str, template: str
) -> None:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    structure = Structure(
        tools=(WEATHER, TIME), tool_format=tool_format_of(tokenizer.chat_template)
    )
    calls = template_calls([ToolCall("call_1", "get_weather", '{"city": "Oslo"}')])
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
    ]
    tools = structure.template_tools()
    ours = tokenizer.apply_chat_template(messages, tools=tools)
    [theirs], _ = chat_template_utils.render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=tokenizer.chat_template,
        add_generation_prompt=True,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    assert ours == theirs
    assert '"get_time"' in ours and "sunny" in ours
    assert calls_text(
        [ToolCall("c", "get_weather", '{"city": "Oslo"}')], structure.tool_format
    ) in (ours)
