"""Every endpoint of the HTTP front door, fuzzed from its own OpenAPI document by
schemathesis against a running stack: no answer is a 5xx, and every refusal is an
OpenAI error body (Anthropic's on the Messages API's paths)."""

from __future__ import annotations

import http.client
import json
import os
import uuid
from urllib.parse import urlsplit

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from tests.e2e.conftest import Stack

# TOLLGATE_FUZZ_EXAMPLES raises the count for a longer hunt.
EXAMPLES = int(os.environ.get("TOLLGATE_FUZZ_EXAMPLES", "60"))
ERROR_FIELDS = {"message", "type", "param", "code"}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fuzz_key(stack: Stack) -> str:
    return stack.tenant_key("fuzz")


@schemathesis.check
def api_error_body(ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:  # fmt: skip
    """A refusal is `{"error": {"message", "type", "param", "code"}}`, or Anthropic's
    `{"type": "error", "error": {"type", "message"}}` on its paths."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    if case.path in ANTHROPIC_PATHS:
        assert isinstance(body, dict) and body.get("type") == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
        return True
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == ERROR_FIELDS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return True


def test_no_endpoint_answers_5xx_and_every_error_has_its_apis_shape(
    stack: Stack, fuzz_key: str
) -> None:
    api = schemathesis.openapi.from_url(f"{stack.http}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 7
    for operation in operations:
        for mode in schemathesis.GenerationMode:
            fuzz(operation, mode, fuzz_key)
        print(f"{operation.label}: {2 * EXAMPLES} requests (valid and invalid), no 5xx")


def fuzz(operation: schemathesis.APIOperation, mode: schemathesis.GenerationMode, key: str) -> None:
    @given(case=operation.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def one(case: schemathesis.Case) -> None:
        # The tenant's key, unless the case fuzzes the authorization header itself.
        headers = {"authorization": f"Bearer {key}", **(case.headers or {})}
        response = case.call(headers=headers, timeout=120)
        assert response.headers.get("x-request-id"), "every answer carries x-request-id"
        case.validate_response(response, checks=[not_a_server_error, api_error_body])

    one()


TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
NUMBER = st.one_of(st.none(), st.integers(-(2**70), 2**70), st.floats(), st.sampled_from([1e999]))
BODIES = st.fixed_dictionaries(
    {"model": st.just("tiny")},
    optional={
        "max_tokens": st.one_of(st.integers(-2, 6), NUMBER),
        "max_completion_tokens": st.integers(-2, 6),
        "temperature": NUMBER,
        "top_p": NUMBER,
        "top_k": NUMBER,
        "seed": NUMBER,
        "stop": st.one_of(TEXT, st.lists(TEXT, max_size=10)),
        "n": NUMBER,
        "stream": st.booleans(),
        "user": TEXT,
        "ignore_eos": st.booleans(),
    },
)
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", ""]), "content": TEXT}),
    max_size=3,
)


@given(
    body=BODIES,
    prompt=st.one_of(TEXT, st.lists(TEXT, max_size=2)),
    messages=MESSAGES,
    chat=st.booleans(),
    key=st.sampled_from(["", "k", "\u00e9"]),
)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_runs_of_the_served_model_with_any_fields_never_answer_5xx(
    stack: Stack, fuzz_key: str, body: dict, prompt: object, messages: list, chat: bool, key: str
) -> None:
    """Bodies that name the served model, so that many of them really run."""
    path, extra = (
        ("/v1/chat/completions", {"messages": messages})
        if chat
        else ("/v1/completions", {"prompt": prompt})
    )
    headers = {"authorization": f"Bearer {fuzz_key}", "content-type": "application/json"}
    if key:
        headers["idempotency-key"] = f"{key}-{uuid.uuid4()}"
    host = urlsplit(stack.http).netloc
    conn = http.client.HTTPConnection(host, timeout=120)
    conn.request("POST", path, json.dumps({**body, **extra}), headers)
    answer = conn.getresponse()
    data = answer.read()
    conn.close()
    assert answer.status < 500, data
    assert answer.getheader("x-request-id")
    if answer.status >= 400:
        assert set(json.loads(data)["error"]) == ERROR_FIELDS
