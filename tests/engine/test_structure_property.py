"""Property: whatever the schema (within what the grammar engine supports) and whatever the
weights, a constrained answer is JSON that validates against it.

200 random schemas are drawn from a seeded generator and run as one batch on the tiny
model, whose random weights try every corner of a schema that a trained model would not.
Every schema bounds its answer (strings by maxLength, arrays by maxItems, integers by a
range), so each answer ends within the tokens it is given.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import jsonschema

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

NUM_SCHEMAS = 200
MAX_TOKENS = 400
WORDS = ["red", "green", "a b", "é", 'x"y', "42", ""]


def draw_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random JSON schema whose every valid instance is short."""
    # No "number": nothing bounds how many digits its fraction may have.
    kinds = ["string", "enum", "integer", "boolean", "null", "const"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(0, 8)}
        if rng.random() < 0.3:
            schema["minLength"] = rng.randint(0, schema["maxLength"])
        if rng.random() < 0.2:
            schema = {"type": "string", "pattern": rng.choice(["^[a-z]{1,5}$", "^[0-9]{3}$"])}
        return schema
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice([*WORDS, 7, True, None])}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": kind, "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "array":
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": draw_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    if kind == "anyOf":
        return {"anyOf": [draw_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(["id", "name", "tags", "ok", "n", "när", "a-b"], rng.randint(0, 4))
    return {
        "type": "object",
        "properties": {name: draw_schema(rng, depth + 1) for name in names},
        "required": [n for n in names if rng.random() < 0.7],
        "additionalProperties": False,
    }


def test_every_answer_validates_against_its_schema(make_engine: Callable[..., LLMEngine]) -> None:
    rng = random.Random(37)
    wrapped = {"properties": {"v": draw_schema(rng)}, "required": ["v"]}
    schemas = [{"type": "object", **wrapped, "additionalProperties": False}]
    schemas += [draw_schema(rng) for _ in range(NUM_SCHEMAS - 1)]
    engine = make_engine(num_kv_blocks=4096, max_num_batched_tokens=2048, max_num_seqs=256)
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=1.0 if i % 2 else 0.0,
            seed=i,
            json_schema=json.dumps(schema),
        )
        for i, schema in enumerate(schemas)
    ]
    answers = engine.generate(["Answer in JSON:"] * len(schemas), params)
    for schema, answer in zip(schemas, answers, strict=True):
        assert answer.finish_reason == "stop", (schema, answer.text)
        jsonschema.validate(json.loads(answer.text), schema)
