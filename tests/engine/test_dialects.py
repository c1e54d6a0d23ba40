"""Each kind of engine server's bodies and chunks, against fixtures written from that
server's source at the version each fixture names (tests/fixtures/engines/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.dialects import (
    DIALECTS,
    DONE,
    Delta,
    MalformedChunk,
    Request,
    cache_salt,
    sse_data,
    unsupported,
    waiting,
)
from engine.errors import RequestError
from engine.sampling import Priority, SamplingParams

FIXTURES = Path(__file__).parents[1] / "fixtures" / "engines"
KINDS = ("vllm", "sglang", "llama-server", "openai")
# The built-in engine's name for an output ended by a stop string.
OURS = {"stop": "stop_sequence"}


def fixture(kind: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / f"{kind}.json").read_text()))


def read_stream(kind: str, lines: list[str], logprobs: int | None = None) -> list[Delta]:
    reader = DIALECTS[kind].reader(logprobs)
    deltas = []
    for line in lines:
        data = sse_data(b"data: " + line.encode())
        if data is DONE:
            break
        assert data is not None
        deltas.append(reader.read(data))
    return deltas


def summed(deltas: list[Delta]) -> dict[str, Any]:
    """The run as the deltas tell it; a count no chunk gave is 0, as the engine takes it."""
    ends = [d.finish_reason for d in deltas if d.finish_reason is not None]
    assert len(ends) == 1
    return {
        "token_ids": [t for d in deltas for t in d.token_ids],
        "text": "".join(d.text for d in deltas),
        "finish_reason": ends[0],
        "prompt_tokens": next(d.num_prompt_tokens for d in reversed(deltas) if d.num_prompt_tokens is not None),
        "cached_prompt_tokens": next(
            (d.num_cached_prompt_tokens for d in reversed(deltas) if d.num_cached_prompt_tokens is not None),
            0,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_a_generation_reads_back_as_the_server_sent_it(kind: str) -> None:
    found = fixture(kind)
    expected = found["expected"]
    got = summed(read_stream(kind, found["stream"]))
    if expected["token_ids"] is None:  # an OpenAI server sends text only
        assert got["token_ids"] == []
    else:
        assert got["token_ids"] == expected["token_ids"]
    assert got["text"] == expected["text"]
    assert got["finish_reason"] == expected["finish_reason"]
    assert got["prompt_tokens"] == expected["prompt_tokens"]
    assert got["cached_prompt_tokens"] == expected["cached_prompt_tokens"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_string_ends_the_output_without_its_text(kind: str) -> None:
    example = fixture(kind)["stop_example"]
    expected = example["expected"]
    got = summed(read_stream(kind, example["stream"]))
    assert got["text"] == expected["text"]
    if expected["token_ids"] is not None:
        assert got["token_ids"] == expected["token_ids"]
    # OpenAI's API does not say which stop ended the output.
    wanted = expected["finish_reason"] if kind == "openai" else OURS[expected["finish_reason"]]
    assert got["finish_reason"] == wanted


SAMPLING = SamplingParams(
    max_tokens=4, temperature=0, seed=7, stop=("\n",), stop_token_ids=(2,), ignore_eos=True
)


@pytest.mark.parametrize("kind", KINDS)
def test_the_body_carries_every_field_the_fixture_request_has(kind: str) -> None:
    """The fixture's request is the server's documented one for the same run: every field
    it names is in ours with the same value, but for ids and salts that are ours to pick."""
    example = fixture(kind)["request_example"]
    request = Request(
        prompt=[1, 2, 3],
        params=SamplingParams(max_tokens=4, temperature=0, seed=7, stop=("\n",)),
        model=example.get("model", "m"),
        cache_namespace="tenant-a",
        send_priority=True,
    )
    ours_to_pick = {"rid", "cache_salt", "id_slot", "cache_prompt", "priority"}
    expected = {name: value for name, value in example.items() if name not in ours_to_pick}
    assert_carries(DIALECTS[kind].body(request), expected)


def assert_carries(body: dict[str, Any], expected: dict[str, Any]) -> None:
    """Every field of `expected` is in `body` with the same value (`sampling_params`
    field by field)."""
    for name, value in expected.items():
        if name == "sampling_params":
            for key, inner in value.items():
                assert body[name][key] == inner, key
        else:
            assert body[name] == value, name


def test_vllm_gets_a_salt_per_namespace_and_priority_lower_first() -> None:
    def body(namespace: str, priority: Priority) -> dict[str, Any]:
        request = Request(
            [1], SAMPLING, "m", cache_namespace=namespace, priority=priority, send_priority=True
        )
        return DIALECTS["vllm"].body(request)

    a, b = body("tenant/a@1", Priority.INTERACTIVE), body("tenant-b", Priority.BATCH)
    assert a["cache_salt"] != b["cache_salt"]
    assert a["cache_salt"] == cache_salt("tenant/a@1") and not set("@/\\") & set(a["cache_salt"])
    assert 1 <= len(a["cache_salt"]) <= 128
    assert a["priority"] < b["priority"]
    assert a["stop_token_ids"] == [2] and a["ignore_eos"] and a["return_token_ids"]
    assert "priority" not in DIALECTS["vllm"].body(Request([1], SAMPLING, "m"))


def test_sglang_serves_higher_priorities_first_and_names_adapters_as_lora_paths() -> None:
    interactive = DIALECTS["sglang"].body(
        Request(
            [1], SAMPLING, "m", adapter="sql", priority=Priority.INTERACTIVE, send_priority=True
        )
    )
    batch = DIALECTS["sglang"].body(
        Request([1], SAMPLING, "m", priority=Priority.BATCH, send_priority=True)
    )
    assert interactive["priority"] > batch["priority"]
    assert interactive["lora_path"] == "sql" and "lora_path" not in batch
    assert "seed" not in interactive["sampling_params"]  # SGLang refuses it: sampling_seed
    assert interactive["sampling_params"]["sampling_seed"] == 7


def test_llama_server_shares_no_cached_prompt_unless_told() -> None:
    body = DIALECTS["llama-server"].body(Request([1], SAMPLING, "m", cache_namespace="t"))
    assert body["cache_prompt"] is False and body["return_tokens"] is True
    shared = DIALECTS["llama-server"].body(Request([1], SAMPLING, "m", share_cache=True))
    assert shared["cache_prompt"] is True


def test_sglang_streams_cumulative_output_that_must_not_go_backwards() -> None:
    reader = DIALECTS["sglang"].reader(None)
    meta = {"finish_reason": None, "prompt_tokens": 3}
    assert reader.read({"text": "ab", "output_ids": [1, 2], "meta_info": meta}).token_ids == (1, 2)
    assert reader.read({"text": "abc", "output_ids": [1, 2, 3], "meta_info": meta}).text == "c"
    with pytest.raises(MalformedChunk):
        reader.read({"text": "a", "output_ids": [1], "meta_info": meta})


@pytest.mark.parametrize(
    ("kind", "chunk"),
    [
        ("vllm", {"choices": [{"text": 3, "finish_reason": None}]}),
        ("vllm", {"choices": [{"text": "a", "token_ids": ["x"], "finish_reason": None}]}),
        ("vllm", {"choices": [{"text": "a", "finish_reason": "exploded"}]}),
        ("vllm", {"object": "text_completion"}),
        ("sglang", {"text": "a", "output_ids": [1]}),
        ("sglang", {"text": "a", "output_ids": [1], "meta_info": {"finish_reason": {"type": "?"}}}),
        ("llama-server", {"content": "a", "tokens": [1]}),
        ("llama-server", {"content": "a", "tokens": [1], "stop": True, "stop_type": "weird"}),
    ],
)
def test_a_malformed_chunk_is_refused_not_guessed(kind: str, chunk: dict[str, Any]) -> None:
    with pytest.raises(MalformedChunk):
        DIALECTS[kind].reader(None).read(chunk)


def test_sse_lines() -> None:
    assert sse_data(b"data: [DONE]") is DONE
    assert sse_data(b": keep-alive") is None and sse_data(b"") is None
    assert sse_data(b'data: {"a": 1}') == {"a": 1}
    deep = b"data: " + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000
    for bad in (deep, b"data: {nope", b"data: [1, 2]", b'data: {"error": {"message": "boom"}}'):
        with pytest.raises(MalformedChunk):
            sse_data(bad)


def test_only_openai_servers_refuse_parameters_and_only_those_set() -> None:
    assert unsupported("openai", {"top_k": 5}) == ("top_k", "OpenAI's completions API has no top_k")
    assert unsupported("openai", {"top_k": 0, "ignore_eos": False, "seed": 3}) is None
    assert unsupported("openai", {"stop_token_ids": [2]}) is not None
    for kind in ("vllm", "sglang", "llama-server"):
        assert unsupported(kind, {"top_k": 5, "ignore_eos": True, "stop_token_ids": [2]}) is None


def test_only_the_built_in_engine_scores_prompts_and_hermes_calls_need_lark() -> None:
    for kind in ("openai", "vllm", "sglang", "llama-server"):
        assert unsupported(kind, {"prompt_logprobs": True})[0] == "prompt_logprobs"  # type: ignore[index]
    required = {"tools": [{"name": "f"}], "tool_choice": {"mode": "required"}}
    assert unsupported("sglang", required) is None
    assert unsupported("sglang", {**required, "tool_format": "hermes"})[0] == "tools"  # type: ignore[index]
    assert unsupported("vllm", {**required, "tool_format": "hermes"}) is None


def test_waiting_requests_are_read_from_prometheus_text() -> None:
    text = (
        "# HELP vllm:num_requests_waiting Number of requests waiting.\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting_total{model_name="m"} 9.0\n'
        "llamacpp:requests_deferred 0\n"
    )
    assert waiting(text, "vllm:num_requests_waiting") == 3.0
    assert waiting(text, "llamacpp:requests_deferred") == 0.0
    assert waiting(text, "sglang:num_queue_reqs") is None


def test_penalties_and_biases_go_under_each_servers_names() -> None:
    params = SamplingParams(
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.3,
        min_p=0.1,
        logit_bias=((7, -100.0), (3, 2.0)),
    )
    request = Request([1], params, "m")
    vllm = DIALECTS["vllm"].body(request)
    assert (vllm["frequency_penalty"], vllm["presence_penalty"]) == (0.5, -0.5)
    assert (vllm["repetition_penalty"], vllm["min_p"]) == (1.3, 0.1)
    assert vllm["logit_bias"] == {"3": 2.0, "7": -100.0}
    sampling = DIALECTS["sglang"].body(request)["sampling_params"]
    assert sampling["repetition_penalty"] == 1.3 and sampling["logit_bias"] == {
        "3": 2.0,
        "7": -100.0,
    }
    llama = DIALECTS["llama-server"].body(request)
    assert llama["repeat_penalty"] == 1.3 and llama["min_p"] == 0.1
    assert llama["logit_bias"] == [[3, 2.0], [7, -100.0]] and "repetition_penalty" not in llama
    plain = DIALECTS["vllm"].body(Request([1], SamplingParams(), "m"))
    assert not {"frequency_penalty", "repetition_penalty", "min_p", "logit_bias"} & set(plain)
    assert unsupported("openai", {"repetition_penalty": 1.3}) is not None
    assert unsupported("openai", {"repetition_penalty": 1.0, "frequency_penalty": 1.0}) is None


# The kinds that name tokens by id, and so can say which token each logprob is of.
LOGPROB_KINDS = ("vllm", "sglang", "llama-server")


def logprobs_of(deltas: list[Delta]) -> list[list[Any]]:
    return [
        [lp.token_id, lp.logprob, [list(pair) for pair in lp.top]]
        for d in deltas
        for lp in d.logprobs
    ]


@pytest.mark.parametrize("kind", LOGPROB_KINDS)
def test_logprobs_read_back_one_per_token_with_the_k_likeliest(kind: str) -> None:
    example = fixture(kind)["logprobs_example"]
    deltas = read_stream(kind, example["stream"], logprobs=2)
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == example["expected"]["token_ids"]
    assert logprobs_of(deltas) == example["expected"]["logprobs"]
    # Fewer alternatives than the server sent: the likeliest of them.
    expected = example["expected"]["logprobs"]
    fewer = logprobs_of(read_stream(kind, example["stream"], logprobs=1))
    assert fewer == [[token, logprob, top[:1]] for token, logprob, top in expected]
    # A run that asked for none reads none, whatever the server sends.
    assert not any(d.logprobs for d in read_stream(kind, example["stream"]))


SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.mark.parametrize("kind", LOGPROB_KINDS)
def test_logprobs_and_a_json_schema_go_under_each_servers_names(kind: str) -> None:
    found = fixture(kind)
    logprobs = DIALECTS[kind].body(Request([1], SamplingParams(logprobs=2), "m"))
    assert_carries(logprobs, found["logprobs_example"]["request_delta"])
    schema = DIALECTS[kind].body(Request([1], SamplingParams(json_schema=SCHEMA), "m"))
    assert_carries(schema, found["json_schema_example"]["request_delta"])
    plain = DIALECTS[kind].body(Request([1], SamplingParams(), "m"))
    asked = {
        *found["logprobs_example"]["request_delta"],
        *found["json_schema_example"]["request_delta"],
    }
    assert not (asked - {"sampling_params"}) & set(plain)
    assert "json_schema" not in plain.get("sampling_params", {})


def test_vllm_takes_the_lark_grammar_of_tools_with_tool_choice_auto() -> None:
    example = fixture("vllm")["grammar_example"]["request_delta"]
    grammar = example["structured_outputs"]["grammar"]
    body = DIALECTS["vllm"].body(Request([1], SamplingParams(grammar=grammar), "m"))
    assert_carries(body, example)


def test_llama_server_is_asked_for_one_alternative_when_the_run_wants_none() -> None:
    """With n_probs 0 it sends no logprobs, not even the sampled token's."""
    body = DIALECTS["llama-server"].body(Request([1], SamplingParams(logprobs=0), "m"))
    assert body["n_probs"] == 1
    stream = fixture("llama-server")["logprobs_example"]["stream"]
    deltas = read_stream("llama-server", stream, logprobs=0)
    assert [lp.top for d in deltas for lp in d.logprobs] == [()] * 4


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("openai", SamplingParams(json_schema=SCHEMA)),
        ("openai", SamplingParams(grammar="start: /a/")),
        ("openai", SamplingParams(logprobs=0)),
        ("sglang", SamplingParams(grammar="start: /a/")),
        ("llama-server", SamplingParams(grammar="start: /a/")),
    ],
)
def test_a_run_asking_what_its_server_cannot_honour_fails_in_its_body(
    kind: str, params: SamplingParams
) -> None:
    """Admission refuses these only when no server of the model honours them."""
    with pytest.raises(RequestError):
        DIALECTS[kind].body(Request([1], params, "m"))


TOOLS = [{"name": "f"}]


@pytest.mark.parametrize(
    ("sampling", "refused_by"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": SCHEMA}}, {"openai"}),
        ({"response_format": {"type": "json_object"}}, {"openai"}),
        ({"response_format": {"type": "text"}}, set()),
        # tools with tool_choice auto, said or not: text or calls, a Lark grammar
        ({"tools": TOOLS}, {"openai", "sglang", "llama-server"}),
        ({"tools": TOOLS, "tool_choice": {"mode": "auto"}}, {"openai", "sglang", "llama-server"}),
        # required or a named function: a JSON schema
        ({"tools": TOOLS, "tool_choice": {"mode": "required"}}, {"openai"}),
        ({"tools": TOOLS, "tool_choice": {"mode": "function", "function": "f"}}, {"openai"}),
        ({"tools": TOOLS, "tool_choice": {"mode": "none"}}, set()),
        ({"logprobs": True, "top_logprobs": 3}, {"openai"}),
        ({"logprobs": False, "top_logprobs": 0}, set()),
    ],
)
def test_each_kind_refuses_the_structure_and_logprobs_it_cannot_honour(
    sampling: dict[str, Any], refused_by: set[str]
) -> None:
    refused = {kind: unsupported(kind, sampling) for kind in KINDS}
    assert {kind for kind, found in refused.items() if found} == refused_by
    for found in refused.values():
        if found is not None:
            assert found[0] in sampling and found[1]


@pytest.mark.parametrize(
    ("kind", "chunk"),
    [
        ("vllm", {"choices": [{"text": "a", "token_ids": [1], "logprobs": None}]}),
        (
            "vllm",
            {
                "choices": [
                    {
                        "text": "a",
                        "token_ids": [1],
                        "logprobs": {"token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}]},
                    }
                ]
            },
        ),
        (
            "sglang",
            {
                "text": "ab",
                "output_ids": [1, 2],
                "meta_info": {
                    "output_token_logprobs": [[-0.5, 1, None]],
                    "output_top_logprobs": [],
                },
            },
        ),
        ("llama-server", {"content": "a", "tokens": [1], "stop": False}),
    ],
)
def test_logprobs_missing_or_not_by_token_id_are_refused(kind: str, chunk: dict[str, Any]) -> None:
    with pytest.raises(MalformedChunk):
        DIALECTS[kind].reader(1).read(chunk)
