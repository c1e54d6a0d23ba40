"""The OpenAI-compatible HTTP front door of a running stack, through the clients people
use: the official `openai` SDK, `curl -N`, and a bare socket."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import psutil
import pytest

from services.core.live import parse_position
from tests.e2e.conftest import Stack
from tests.services.worker.running import engine_of

CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.tenant_key("http")


@pytest.fixture(scope="module")
def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=0)


def request(
    stack: Stack, key: str, method: str, path: str, body: object = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    host = urlsplit(stack.http).netloc
    conn = http.client.HTTPConnection(host, timeout=60)
    sent = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    sent |= {k.replace("_", "-"): v for k, v in headers.items()}
    conn.request(method, path, json.dumps(body) if body is not None else None, sent)
    answer = conn.getresponse()
    data = answer.read()
    conn.close()
    return answer.status, {k.lower(): v for k, v in answer.getheaders()}, data


def sse_events(text: str) -> list[dict[str, str]]:
    """The events of a server-sent-event stream, as {"id": ..., "data": ...}."""
    events = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            name, _, value = line.partition(": ")
            fields[name] = value
        if "data" in fields:
            events.append(fields)
    return events


def streamed_text(events: list[dict[str, str]]) -> str:
    """The tokens' text in a stream of run events (`GET /v1/runs/{id}/events`)."""
    return "".join(json.loads(e["data"]).get("streaming", {}).get("text", "") for e in events)


def test_chat_completion_streams_chunks_then_a_usage_chunk(sdk: openai.OpenAI) -> None:
    chunks = list(
        sdk.chat.completions.create(
            model="tiny",
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert usage.completion_tokens >= 1 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= 0
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("run_")
    whole = sdk.chat.completions.create(
        model="tiny",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    assert whole.choices[0].message.content == text  # greedy: the same answer
    assert whole.usage is not None and whole.usage.completion_tokens == usage.completion_tokens


def test_text_completion_and_models(sdk: openai.OpenAI) -> None:
    answer = sdk.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0)
    assert answer.object == "text_completion"
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 4
    streamed = sdk.completions.create(
        model="tiny", prompt="Once upon", max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == answer.choices[0].text
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    assert sdk.models.retrieve("tiny").owned_by == "tollgate"


def test_sdk_exceptions_for_each_refusal(stack: Stack, sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="tiny", messages=CHAT, max_tokens=0)  # type: ignore[arg-type]
    assert bad.value.param == "max_tokens"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as many:
        sdk.chat.completions.create(model="tiny", messages=CHAT, n=17)  # type: ignore[arg-type]
    assert many.value.param == "n"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as tools:
        sdk.chat.completions.create(
            model="tiny",
            messages=CHAT,  # type: ignore[arg-type]
            tools=[{"type": "function", "function": {"name": "no spaces"}}],
        )
    assert tools.value.param == "tools[0].function.name"  # type: ignore[attr-defined]
    stranger = openai.OpenAI(base_url=f"{stack.http}/v1", api_key="tg_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    with pytest.raises(openai.AuthenticationError):  # the key first, then the body
        stranger.chat.completions.create(model="tiny", messages=CHAT, n=5)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    first = sdk.completions.with_raw_response.create(
        model="tiny", prompt="a", max_tokens=2, extra_headers=key
    )
    again = sdk.completions.with_raw_response.create(
        model="tiny", prompt="a", max_tokens=2, extra_headers=key
    )
    run_id = first.headers["x-request-id"]
    assert run_id.startswith("run_") and again.headers["x-request-id"] == run_id
    assert again.parse().choices[0].text == first.parse().choices[0].text
    with pytest.raises(openai.ConflictError) as reused:
        sdk.completions.create(model="tiny", prompt="b", max_tokens=2, extra_headers=key)
    assert reused.value.response.headers["x-request-id"] == run_id


def test_penalties_and_biases_reach_the_sampler(stack: Stack, sdk: openai.OpenAI) -> None:
    client = stack.tenant_client("bias")
    options: dict[str, Any] = dict(model="tiny", max_tokens=12, temperature=0, ignore_eos=True)
    greedy = [t for e in client.generate("Once upon a time", **options) for t in e.token_ids]
    banned = {token: -100.0 for token in greedy}
    steered = client.generate("Once upon a time", logit_bias=banned, **options)
    tokens = [t for e in steered for t in e.token_ids]
    assert len(tokens) == 12 and not set(tokens) & set(greedy)
    answer = sdk.chat.completions.create(
        model="tiny",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=4,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={str(greedy[0]): -100},
        extra_body={"repetition_penalty": 1.1, "min_p": 0.05},
    )
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(
            model="tiny",
            messages=CHAT,  # type: ignore[arg-type]
            frequency_penalty=2.5,
        )
    assert refused.value.param == "frequency_penalty"  # type: ignore[attr-defined]


def test_quota_refusal_is_a_429_with_retry_after(stack: Stack) -> None:
    tenant = stack.admin.create_tenant(f"http-quota-{uuid.uuid4().hex[:6]}")
    stack.admin.set_quota(tenant.tenant_id, max_kv_blocks=1)
    key = stack.admin.create_api_key(tenant.tenant_id).secret
    limited = openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        limited.completions.create(model="tiny", prompt="a long enough prompt", max_tokens=64)
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.body["code"] == "resource_exhausted"  # type: ignore[index]


def test_admitted_answers_carry_the_rate_limit_headers(stack: Stack) -> None:
    tenant = stack.admin.create_tenant(f"http-rates-{uuid.uuid4().hex[:6]}")
    stack.admin.set_quota(tenant.tenant_id, requests_per_minute=5, output_tokens_per_minute=100)
    key = stack.admin.create_api_key(tenant.tenant_id).secret
    sdk = openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=0)
    for stream in (False, True):
        answer = sdk.completions.with_raw_response.create(
            model="tiny", prompt="a", max_tokens=4, stream=stream
        )
        assert answer.headers["x-ratelimit-limit-requests"] == "5"
        assert answer.headers["x-ratelimit-remaining-requests"] == str(4 - stream)
        assert answer.headers["x-ratelimit-limit-tokens"] == "100"
        assert answer.headers["x-ratelimit-reset-tokens"].endswith("s")


def test_curl_resumes_from_last_event_id_with_exactly_the_tail(stack: Stack, key: str) -> None:
    """A client killed mid-stream resumes from the last `id:` it read."""
    body = {"model": "tiny", "prompt": "Tell", "max_tokens": 40, "temperature": 0, "stream": True}
    curl = subprocess.Popen(
        ["curl", "-sN", f"{stack.http}/v1/completions", "-H", f"authorization: Bearer {key}",
         "-H", "content-type: application/json", "-H", "x-tollgate-disconnect-grace: 60",
         "-D", "-", "-d", json.dumps(body)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert curl.stdout is not None
    head, received = _read_until_chunks(curl.stdout, 3)
    curl.kill()
    curl.wait()
    run_id = head["x-request-id"]
    last_id = received[-1]["id"]
    before = "".join(json.loads(e["data"])["choices"][0]["text"] for e in received)
    resumed = subprocess.run(
        ["curl", "-sN", f"{stack.http}/v1/runs/{run_id}/events",
         "-H", f"authorization: Bearer {key}", "-H", f"Last-Event-ID: {last_id}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    tail = sse_events(resumed.stdout)
    # Ids are stored seqs, or positions of tokens sent before they were stored.
    last, first = parse_position(last_id), parse_position(tail[0]["id"])
    assert last is not None and first is not None
    assert (first.seq, first.tokens) > (last.seq, last.tokens)
    assert json.loads(tail[-1]["data"])["state"] == "RUN_STATE_BILLED"
    status, _, everything = request(stack, key, "GET", f"/v1/runs/{run_id}/events")
    assert status == 200
    assert before + streamed_text(tail) == streamed_text(sse_events(everything.decode()))
    _, _, by_query = request(
        stack, key, "GET", f"/v1/runs/{run_id}/events?starting_after={last.seq}"
    )
    assert sse_events(by_query.decode())[0]["id"] == str(last.seq + 1)


def _read_until_chunks(
    lines: Iterator[str], num_chunks: int
) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The response headers curl printed, and the first `num_chunks` SSE events."""
    headers: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            break
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    events, block = [], ""
    for line in lines:
        block += line
        if line == "\n" and block.strip():
            events.extend(sse_events(block))
            block = ""
            if len(events) >= num_chunks:
                break
    return headers, events


@contextlib.contextmanager
def engine_suspended(stack: Stack) -> Iterator[None]:
    """The worker's engine stopped (SIGSTOP), so that its runs stay where they are."""
    port = int(stack.worker.rpartition(":")[2])
    [worker] = {
        c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
    }
    engine = engine_of(psutil.Process(worker))
    assert engine is not None
    engine.suspend()
    try:
        yield
    finally:
        engine.resume()


@pytest.mark.parametrize("stream", [True, False])
def test_a_closed_connection_cancels_the_run_after_the_grace(stack: Stack, stream: bool) -> None:
    key = stack.tenant_key("http-hangup")  # a tenant of its own: its one run is this one
    body = {"model": "tiny", "prompt": "Go", "max_tokens": 2000, "stream": stream}
    host, port = urlsplit(stack.http).netloc.split(":")
    with engine_suspended(stack), socket.create_connection((host, int(port))) as conn:
        payload = json.dumps({**body, "ignore_eos": True}).encode()
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {key}\r\nx-tollgate-disconnect-grace: 0.2\r\n".encode()
            + f"content-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        if stream:
            conn.recv(65536)  # the headers: the run is admitted
        conn.close()
        with stack.client(key) as client:
            deadline = time.monotonic() + 60
            while not (runs := client.list_runs().runs) and time.monotonic() < deadline:
                time.sleep(0.05)
            run_id = runs[0].run_id
            # Reading the events attaches as a resumed stream would: wait till it ended.
            while client.get_run(run_id).state in ("queued", "prefill", "streaming"):
                assert time.monotonic() < deadline
                time.sleep(0.1)
    status, _, data = request(stack, key, "GET", f"/v1/runs/{run_id}/events")
    ended = [json.loads(e["data"]) for e in sse_events(data.decode())][-2]
    assert status == 200 and ended["cancelled"]["reason"] == "client disconnected"
    assert "unexpected error" not in (stack.log_dir / "admission.log").read_text()


def test_runs_are_read_and_cancelled_over_http(stack: Stack, key: str) -> None:
    status, headers, data = request(
        stack, key, "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}
    )
    run_id = headers["x-request-id"]
    assert status == 200 and json.loads(data)["id"] == run_id
    status, _, data = request(stack, key, "GET", f"/v1/runs/{run_id}")
    run = json.loads(data)
    assert status == 200 and run["run_id"] == run_id and run["model"] == "tiny"
    status, _, data = request(stack, key, "POST", f"/v1/runs/{run_id}/cancel")
    assert status == 200 and json.loads(data)["state"] != "RUN_STATE_CANCELLED"  # it had ended
    other = stack.tenant_key("http-other")
    status, headers, data = request(stack, other, "GET", f"/v1/runs/{run_id}")
    assert status == 404 and set(json.loads(data)["error"]) == {"message", "type", "param", "code"}
    assert headers["x-request-id"]
    status, _, data = request(stack, key, "GET", f"/v1/runs/{run_id}/events", last_event_id="x")
    assert status == 400 and json.loads(data)["error"]["param"] == "Last-Event-ID"


def test_openapi_document_lists_the_endpoints(stack: Stack) -> None:
    status, _, data = request(stack, "", "GET", "/openapi.json")
    paths = json.loads(data)["paths"]
    assert status == 200
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/runs/{run_id}/events",
    } <= set(paths)


def readme_snippet(name: str) -> str:
    """The code block after `<!-- http-snippet: NAME -->` in the README."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    after = readme.split(f"<!-- http-snippet: {name} -->", 1)[1]
    return after.split("```", 2)[1].split("\n", 1)[1]


def test_the_readme_snippets_work_when_pasted(stack: Stack, key: str, tmp_path: Path) -> None:
    """Run as printed, in a directory whose stack.json names this stack, with its model."""
    (tmp_path / ".tollgate" / "stack").mkdir(parents=True)
    stack_file = {"http": stack.http, "api_key": key, "gateway": stack.gateway}
    (tmp_path / ".tollgate" / "stack" / "stack.json").write_text(json.dumps(stack_file))

    def pasted(name: str) -> str:
        snippet = readme_snippet(name).replace("http://127.0.0.1:8080", stack.http)
        return snippet.replace("smollm2-135m-instruct", "tiny")

    curl = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", pasted("curl")],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert curl.returncode == 0, curl.stderr
    assert curl.stdout.rstrip().endswith("data: [DONE]")
    python = subprocess.run(
        [sys.executable, "-c", pasted("python")],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert python.returncode == 0, python.stderr
