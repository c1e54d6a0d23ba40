"""What an HTTP request meets before its body is parsed, on real sockets: the key is
checked before any body byte is read, bodies are bounded (by `content-length` and as they
stream), JSON nesting is bounded, failed keys are limited per transport peer whatever
`X-Forwarded-For` says, and a bad `Last-Event-ID` is a 400."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from services.admission.http.app import create_app
from services.admission.http.limits import DEFAULT_LIMITS
from tests.services.admission.calls import count_runs, first_event
from tests.services.admission.calls import request as generate_request
from tests.services.admission.raw_http import (
    answer_of,
    connect,
    exchange,
    request,
    serving,
)
from tests.services.admission.running import MODEL, Admission

SMALL = replace(DEFAULT_LIMITS, max_body_bytes=64 * 1024)


def head(path: str, key: str, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: tollgate\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\n{extra}\r\n"
    ).encode()


async def test_a_wrong_key_is_refused_before_any_of_the_body_is_read(
    admission: Admission,
) -> None:
    async with serving(create_app(admission.core)) as port:
        # A gigabyte announced and none of it sent: the answer comes all the same.
        data = head("/v1/chat/completions", "tg_wrong", "content-length: 1000000000\r\n")
        answer = await exchange(port, data, timeout=5)
        assert answer is not None and answer.status == 401, answer
        assert answer.json()["error"]["type"] == "authentication_error"
        assert answer.headers["connection"] == "close"
        assert answer.headers["x-request-id"]


async def test_a_body_past_the_limit_is_a_413_by_its_length_or_as_it_streams(
    admission: Admission,
) -> None:
    _, key = await admission.new_tenant_key("big-bodies")
    limit = SMALL.max_body_bytes
    async with serving(create_app(admission.core, SMALL), SMALL) as port:
        declared = head("/v1/completions", key, f"content-length: {limit + 1}\r\n")
        answer = await exchange(port, declared, timeout=5)
        assert answer is not None and answer.status == 413, answer
        assert answer.json()["error"]["param"] == "body"
        assert answer.headers["connection"] == "close"

        # Chunked, so no length is declared: refused once the bytes read pass the limit.
        reader, writer = await connect(port)
        writer.write(head("/v1/completions", key, "transfer-encoding: chunked\r\n"))
        for _ in range(limit // 4096 + 1):
            writer.write(b"1000\r\n" + b" " * 4096 + b"\r\n")
        await writer.drain()
        answer = await answer_of(reader, timeout=5)
        writer.close()
        assert answer is not None and answer.status == 413, answer

        # A body of exactly the limit is read and parsed (then refused for its prompt).
        body = json.dumps({"model": MODEL, "prompt": "", "max_tokens": 1}).encode()
        body = body.replace(b'"prompt": ""', b'"prompt": "' + b"a" * (limit - len(body)) + b'"')
        assert len(body) == limit
        answer = await exchange(port, request("POST", "/v1/completions", _json(key), body))
        assert answer is not None and answer.status == 400, answer
        assert answer.json()["error"]["param"] == "prompt"


async def test_json_nested_past_the_bound_is_a_400_naming_the_body(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("deep-bodies")
    depth = DEFAULT_LIMITS.max_json_depth
    async with serving(create_app(admission.core)) as port:
        for body in (
            b"[" * (1 << 20),  # a recursive parser's stack overflows long before the end
            _completion(json.dumps({"x": _nested(depth)})),  # depth + 1 with the body's own
        ):
            answer = await exchange(port, request("POST", "/v1/completions", _json(key), body))
            assert answer is not None and answer.status == 400, answer
            error = answer.json()["error"]
            assert error["param"] == "body" and f"{depth} levels" in error["message"], error
        # At the bound, and with brackets in strings: parsed (then refused for max_tokens).
        body = _completion(json.dumps({"x": _nested(depth - 1), "note": "[[[[{{{{" * 100}))
        answer = await exchange(port, request("POST", "/v1/completions", _json(key), body))
        assert answer is not None and answer.status == 400, answer
        assert answer.json()["error"]["param"] == "max_tokens"


async def test_failed_keys_are_limited_per_peer_whatever_x_forwarded_for_says(
    admission: Admission,
) -> None:
    async def statuses(port: int) -> list[int]:
        found = []
        for i in range(30):
            headers = {"authorization": "Bearer tg_wrong", "x-forwarded-for": f"10.0.{i}.1"}
            answer = await exchange(port, request("GET", "/v1/models", headers))
            assert answer is not None
            found.append(answer.status)
        return found

    async with serving(create_app(admission.core)) as port:
        found = await statuses(port)
    assert found[0] == 401 and 429 in found, found

    # Behind a proxy the operator names, the header names the client, one bucket each.
    trusting = replace(DEFAULT_LIMITS, trusted_proxies=("127.0.0.0/8",))
    async with serving(create_app(admission.core, trusting), trusting) as port:
        assert set(await statuses(port)) == {401}


async def test_a_last_event_id_that_is_no_seq_is_a_400_naming_it(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("resumer")
    run_id = (await first_event(admission, key, generate_request())).run_id
    async with serving(create_app(admission.core)) as port:
        # Superscripts (latin-1 bytes, which `isdigit()` passes and int() refuses), digits
        # past int()'s 4,300, and a number past any seq.
        for value in ("\u00b2", "1\u00b3", "1" * 5000, "9" * 20):
            headers = {"authorization": f"Bearer {key}", "last-event-id": value}
            data = request("GET", f"/v1/runs/{run_id}/events", headers)
            answer = await exchange(port, data)
            assert answer is not None and answer.status == 400, (value[:20], answer)
            assert answer.json()["error"]["param"] == "Last-Event-ID"


def _json(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


def _completion(extra: str) -> bytes:
    """A completion request with `max_tokens` -1 (refused once parsed), and `extra`'s fields."""
    fields = json.loads(extra)
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1, **fields}).encode()


def _nested(depth: int) -> object:
    value: object = []
    for _ in range(depth - 1):
        value = [value]
    return value


async def test_a_request_sent_whole_then_left_still_runs(admission: Admission) -> None:
    """The key is checked before the body is read; a client gone by then sent it all."""
    _, key = await admission.new_tenant_key("leaver")
    body = json.dumps({"model": MODEL, "prompt": "bye", "max_tokens": 2}).encode()
    headers = {**_json(key), "x-tollgate-disconnect-grace": "0.2"}
    async with serving(create_app(admission.core)) as port:
        _, writer = await connect(port)
        writer.write(request("POST", "/v1/completions", headers, body))
        await writer.drain()
        writer.close()
        async with asyncio.timeout(10):
            while await count_runs(admission) == 0:
                await asyncio.sleep(0.05)


async def test_the_messages_paths_take_x_api_key_and_refuse_in_anthropics_body(
    admission: Admission,
) -> None:
    _, key = await admission.new_tenant_key("anthropic-guard")
    async with serving(create_app(admission.core, SMALL), SMALL) as port:
        wrong = b"POST /v1/messages HTTP/1.1\r\nhost: t\r\nx-api-key: tg_wrong\r\n"
        answer = await exchange(port, wrong + b"content-length: 100\r\n\r\n", timeout=5)
        assert answer is not None and answer.status == 401, answer
        assert answer.json() == {
            "type": "error",
            "error": {"type": "authentication_error", "message": answer.json()["error"]["message"]},
        }
        assert answer.headers["connection"] == "close"

        declared = head("/v1/messages", key, f"content-length: {SMALL.max_body_bytes + 1}\r\n")
        answer = await exchange(port, declared, timeout=5)
        assert answer is not None and answer.status == 413, answer
        assert answer.json()["error"]["type"] == "request_too_large"

        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        headers = {"x-api-key": key, "content-type": "application/json"}
        counted = await exchange(
            port, request("POST", "/v1/messages/count_tokens", headers, body.encode())
        )
        assert counted is not None and counted.status == 200, counted
        assert counted.json()["input_tokens"] > 0
        # Without max_tokens a message is refused, naming it, in Anthropic's body.
        refused = await exchange(port, request("POST", "/v1/messages", headers, body.encode()))
        assert refused is not None and refused.status == 400, refused
        assert refused.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in refused.json()["error"]["message"]
        # The OpenAI paths keep OpenAI's body.
        answer = await exchange(
            port, head("/v1/completions", "tg_wrong", "connection: close\r\n"), timeout=5
        )
        assert answer is not None and answer.json()["error"]["param"] is None
