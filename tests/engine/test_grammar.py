"""Structured outputs: a JSON schema or a Lark grammar constrains what the engine writes,
on the tiny model (random weights, which would never write JSON unaided) and on SmolLM2."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.errors import RequestError
from engine.grammar import MAX_CACHED_GRAMMARS, Grammars
from engine.llm_engine import LLMEngine
from engine.model_dirs.fetch import FetchError, resolve_model
from engine.sampling import SamplingParams
from engine.structure import FunctionTool, Structure
from tests.engine.helpers import run_all, text_of, tokens_of
from tests.engine.test_engine import prompt
from tollgate.structure import tool_calls_of

MakeEngine = Callable[..., LLMEngine]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "owner": PERSON,
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": -5, "maximum": 5},
            "minItems": 1,
            "maxItems": 4,
        },
    },
    "required": ["tags", "owner", "scores"],
    "additionalProperties": False,
}
ENUM = {"enum": ["approve", "reject", "escalate"]}
# json_object mode: any object. Its strings and keys are unbounded, which a random model
# can fill forever, so only the real model is held to it.
ANY_OBJECT = {"type": "object"}
SCHEMAS = {"person": PERSON, "nested": NESTED, "enum": ENUM, "object": ANY_OBJECT}
BOUNDED = ("person", "nested", "enum")


def constrained(schema: dict[str, Any], **overrides: Any) -> SamplingParams:
    settings: dict[str, Any] = {"max_tokens": 120, "temperature": 0}
    return SamplingParams(json_schema=json.dumps(schema), **(settings | overrides))


# A schema nested past what llguidance compiles (but within what Python parses).
DEEP_SCHEMA = '{"type": "array", "items": ' * 300 + "{}" + "}" * 300


def assert_valid(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(json_schema="{not json"), "json_schema: not valid JSON"),
        (SamplingParams(json_schema="[" * 100_000), "json_schema: not valid JSON: .*deeply"),
        (SamplingParams(json_schema=DEEP_SCHEMA), "json_schema: .*recursion"),
        (SamplingParams(json_schema='{"type": "strin"}'), "json_schema: .*strin"),
        (SamplingParams(json_schema="[1, 2]"), "json_schema: a schema is a JSON object"),
        (SamplingParams(json_schema="false"), "json_schema: a schema is a JSON object"),
        (SamplingParams(grammar="start: missing"), "grammar: .*missing"),
        (SamplingParams(grammar="start: (("), "grammar: "),
    ],
)
def test_an_invalid_schema_or_grammar_is_refused_at_add_request(
    make_engine: MakeEngine, params: SamplingParams, message: str
) -> None:
    engine = make_engine()
    with pytest.raises(RequestError, match=message):
        engine.add_request("bad", prompt(5), params)
    assert not engine.has_unfinished_requests()


def test_a_schema_and_a_grammar_together_are_refused() -> None:
    with pytest.raises(RequestError, match="json_schema and grammar"):
        SamplingParams(json_schema="{}", grammar='start: "x"')


def test_admission_checks_with_the_tokenizer_alone(make_engine: MakeEngine) -> None:
    grammars = Grammars(make_engine().tokenizer)
    grammars.check(json_schema=json.dumps(NESTED))
    grammars.check(grammar='start: "yes" | "no"')
    with pytest.raises(RequestError, match="grammar: "):
        grammars.check(grammar="start: nowhere")
    long_error = "start: " + " ".join(f"r{i}" for i in range(400))
    with pytest.raises(RequestError) as refused:
        grammars.check(grammar=long_error)
    assert len(str(refused.value)) <= 500


@pytest.mark.parametrize("name", BOUNDED)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_tiny_model_writes_valid_json(
    make_engine: MakeEngine, name: str, temperature: float
) -> None:
    schema = SCHEMAS[name]
    engine = make_engine()
    results = engine.generate(
        [prompt(6, seed=i) for i in range(3)],
        [constrained(schema, temperature=temperature, seed=i) for i in range(3)],
    )
    for result in results:
        assert result.finish_reason == "stop", result.text
        assert_valid(result.text, schema)
        assert result.token_ids[-1] not in engine.tokenizer.eos_token_ids


def test_a_lark_grammar_constrains_the_output(make_engine: MakeEngine) -> None:
    engine = make_engine()
    params = [
        SamplingParams(max_tokens=10, temperature=1.5, seed=s, grammar='start: "yes" | "no"')
        for s in range(8)
    ]
    results = engine.generate([prompt(4, seed=s) for s in range(8)], params)
    assert {r.text for r in results} <= {"yes", "no"}
    assert {r.finish_reason for r in results} == {"stop"}


def test_a_lark_grammar_may_embed_a_schema(make_engine: MakeEngine) -> None:
    grammar = 'start: "verdict: " verdict\nverdict: %json ' + json.dumps(ENUM)
    [result] = make_engine().generate(
        [prompt(4)], SamplingParams(max_tokens=30, temperature=0, grammar=grammar)
    )
    assert result.text.startswith("verdict: ")
    assert json.loads(result.text.removeprefix("verdict: ")) in ENUM["enum"]


# Tools whose arguments a random model can finish.
TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Bergen"]}, "days": PERSON["properties"]["age"]},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "get_time": {"type": "object", "properties": {}, "additionalProperties": False},
}


@pytest.mark.parametrize("tool_format", ["generic", "hermes", "llama3"])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_tiny_model_calls_tools_in_each_format(
    make_engine: MakeEngine, tool_format: str, parallel: bool
) -> None:
    structure = Structure(
        tools=tuple(FunctionTool(name, "", json.dumps(schema)) for name, schema in TOOLS.items()),
        tool_choice="required",
        parallel_tool_calls=parallel,
        tool_format=tool_format,
    )
    json_schema, grammar = structure.constraint()
    params = [
        SamplingParams(
            max_tokens=200, temperature=1.0, seed=s, json_schema=json_schema, grammar=grammar
        )
        for s in range(3)
    ]
    results = make_engine().generate([prompt(6, seed=s) for s in range(3)], params)
    for result in results:
        assert result.finish_reason == "stop", result.text
        calls = tool_calls_of(result.text, "run_1")
        assert calls, result.text
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), TOOLS[call.name])


def test_ignore_eos_still_ends_when_the_grammar_is_complete(make_engine: MakeEngine) -> None:
    [result] = make_engine().generate([prompt(5)], constrained(PERSON, ignore_eos=True))
    assert result.finish_reason == "stop"
    assert_valid(result.text, PERSON)


def test_max_tokens_mid_object_ends_with_length(make_engine: MakeEngine) -> None:
    engine = make_engine()
    [whole] = engine.generate([prompt(5)], constrained(NESTED))
    [cut] = engine.generate([prompt(5)], constrained(NESTED, max_tokens=6))
    assert cut.finish_reason == "length"
    assert cut.token_ids == whole.token_ids[:6]
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)


def test_a_preempted_constrained_request_still_writes_valid_json(
    make_engine: MakeEngine,
) -> None:
    """KV is recomputed from the sequence's tokens without resampling, so the matcher,
    which advanced once per token, stays where the output is."""
    prompts = [prompt(n, seed=n) for n in (3, 30, 57, 21, 44)]
    params = [constrained(PERSON, temperature=0.8, seed=i, max_tokens=60) for i in range(5)]
    expected = make_engine(max_num_batched_tokens=512).generate(prompts, params)
    cramped = make_engine(num_kv_blocks=40, max_num_batched_tokens=16)
    results = cramped.generate(prompts, params)
    assert sum(r.metrics.num_preemptions for r in results) > 0
    for result, alone in zip(results, expected, strict=True):
        assert result.token_ids == alone.token_ids
        assert result.finish_reason == "stop"
        assert_valid(result.text, PERSON)


def test_unconstrained_neighbours_get_the_tokens_they_get_alone(
    make_engine: MakeEngine,
) -> None:
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine = make_engine()
    alone = [r.token_ids for r in engine.generate([prompt(7), prompt(9, seed=1)], free)]
    mixed = engine.generate(
        [prompt(7), prompt(12, seed=2), prompt(9, seed=1), prompt(5, seed=3)],
        [free, constrained(NESTED), free, constrained(PERSON, temperature=1.0)],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert_valid(mixed[1].text, NESTED)
    assert_valid(mixed[3].text, PERSON)


def test_each_schema_is_compiled_once(make_engine: MakeEngine) -> None:
    engine = make_engine()
    for i in range(3):
        engine.add_request(f"p{i}", prompt(5, seed=i), constrained(PERSON, temperature=1.0))
    engine.add_request("n", prompt(5), constrained(NESTED))
    outputs = run_all(engine)
    assert engine.grammars.num_compiled == 2
    for i in range(3):
        assert_valid(text_of(outputs[f"p{i}"]), PERSON)
    assert tokens_of(outputs["n"])


def test_the_cache_keeps_the_most_recently_used_grammars(make_engine: MakeEngine) -> None:
    grammars = Grammars(make_engine().tokenizer)
    words = [f'start: "w{i}"' for i in range(MAX_CACHED_GRAMMARS + 1)]
    for grammar in words:
        grammars.check(grammar=grammar)
    grammars.check(grammar=words[-1])
    assert grammars.num_compiled == MAX_CACHED_GRAMMARS + 1
    grammars.check(grammar=words[0])  # dropped to make room for the last
    assert grammars.num_compiled == MAX_CACHED_GRAMMARS + 2


@pytest.fixture(scope="module")
def smollm2() -> LLMEngine:
    try:
        model_dir: Path = resolve_model("smollm2-135m-instruct")[1]
    except FetchError as exc:
        pytest.skip(f"cannot fetch smollm2-135m-instruct: {exc}")
    return LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=256, block_size=16))


QUESTIONS = {
    "person": "Describe a person as JSON with a name and an age.",
    "nested": "Give me JSON: a few colour tags, an owner with name and age, and scores.",
    "enum": "Should this refund be approved, rejected or escalated? Answer in JSON.",
    "object": "List the capitals of France and Italy as a JSON object.",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("names", "temperature"),
    # A small model sampling an unbounded object can ramble past any max_tokens.
    [(tuple(QUESTIONS), 0.0), (BOUNDED, 0.8)],
)
def test_smollm2_writes_valid_json(
    smollm2: LLMEngine, names: tuple[str, ...], temperature: float
) -> None:
    prompts = [
        smollm2.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[name]}])
        for name in names
    ]
    params = [
        constrained(SCHEMAS[name], temperature=temperature, seed=7, max_tokens=200)
        for name in names
    ]
    for name, result in zip(names, smollm2.generate(prompts, params), strict=True):
        assert result.finish_reason == "stop", (name, result.text)
        assert_valid(result.text, SCHEMAS[name])
