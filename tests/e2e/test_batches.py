"""OpenAI's Batch API through the official `openai` SDK, unchanged, against a running
stack: a file uploaded and checked, a batch created and polled to its end, its output
and error files read back in OpenAI's line format; a file with bad lines refused whole;
a batch cancelled midway; and a batch of 200 lines whose worker and admission replica
(the batch's driver) are killed midway, which still ends with one result per line, each
line's run billed once, at the batch discount, and reconciliation clean.
"""

from __future__ import annotations

import io
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import sqlalchemy as sa

from services.stack.infra import Endpoints
from services.stack.launcher import Services
from tests.e2e.conftest import Stack, paste_design_snippet, running_stack
from tests.e2e.test_restarts import kill
from tollgate.cli import main as tollgate

pytestmark = pytest.mark.slow

ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def sdk(stack: Stack) -> openai.OpenAI:
    key = stack.tenant_key("batches")
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=0)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, text: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            **body,
        },
    }


def upload(sdk: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    return sdk.files.create(file=("input.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")


def wait_ended(sdk: openai.OpenAI, batch_id: str, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := sdk.batches.retrieve(batch_id)).status not in ENDED:
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def lines_of(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()]


def test_a_batch_runs_every_line_and_answers_in_openais_format(sdk: openai.OpenAI) -> None:
    lines = [chat_line(f"req-{i}", f"Say {i}") for i in range(5)]
    lines.append(
        {
            "custom_id": "text",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "x" * 9000}]},
        }
    )
    source = upload(sdk, lines)
    assert (source.object, source.purpose, source.status) == ("file", "batch", "processed")
    assert source.bytes == len(jsonl(lines))
    assert sdk.files.retrieve(source.id).filename == "input.jsonl"
    assert sdk.files.content(source.id).read() == jsonl(lines)

    batch = sdk.batches.create(
        input_file_id=source.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status in ("validating", "in_progress")
    assert batch.request_counts is not None and batch.request_counts.total == 6
    ended = wait_ended(sdk, batch.id)
    assert ended.status == "completed", ended
    assert ended.metadata == {"job": "nightly"}
    assert ended.completed_at is not None and ended.in_progress_at is not None
    counts = ended.request_counts
    assert counts is not None
    output = lines_of(sdk, ended.output_file_id)
    errors = lines_of(sdk, ended.error_file_id)
    assert (counts.completed, counts.failed) == (len(output), len(errors))
    by_id = {line["custom_id"]: line for line in [*output, *errors]}
    assert sorted(by_id) == sorted(line["custom_id"] for line in lines)
    for i in range(5):
        answer = by_id[f"req-{i}"]
        assert answer["error"] is None and answer["id"].startswith("batch_req_")
        response = answer["response"]
        assert response["status_code"] == 200
        assert response["request_id"].startswith("run_")
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert 0 < body["usage"]["completion_tokens"] <= 4
    # Over the tiny model's context: refused when its run was to start, a line of the
    # error file with the refusal's status and body.
    refused = by_id["text"]["response"]
    assert refused["status_code"] == 400 and "error" in refused["body"]
    assert sdk.files.retrieve(ended.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in sdk.batches.list()]
    assert source.id in [f.id for f in sdk.files.list(purpose="batch")]


def test_a_file_with_bad_lines_is_refused_naming_them(sdk: openai.OpenAI) -> None:
    lines = [chat_line("a", "hi"), chat_line("a", "again"), chat_line("b", "hi", max_tokens=-1)]
    raw = jsonl(lines) + b"not json\n" + json.dumps({"custom_id": "c", "method": "GET"}).encode()
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.files.create(file=("bad.jsonl", io.BytesIO(raw)), purpose="batch")
    message = refused.value.message
    for expected in (
        "line 2: custom_id",
        "line 3: max_tokens",
        "line 4: line: is not JSON",
        "line 5: method",
    ):
        assert expected in message, message
    assert "line 1" not in message
    with pytest.raises(openai.BadRequestError, match="purpose"):
        sdk.files.create(file=("x.jsonl", io.BytesIO(jsonl(lines[:1]))), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        source = upload(sdk, [chat_line("a", "hi")])
        sdk.batches.create(
            input_file_id=source.id, endpoint="/v1/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        sdk.batches.retrieve("batch_nope")


def test_an_upload_declared_too_large_is_refused_before_its_body(stack: Stack) -> None:
    key = stack.tenant_key("batches-large")
    address = urlsplit(stack.http)
    with socket.create_connection((address.hostname, address.port)) as sock:
        head = (
            "POST /v1/files HTTP/1.1\r\nhost: x\r\n"
            f"authorization: Bearer {key}\r\n"
            "content-type: multipart/form-data; boundary=b\r\n"
            f"content-length: {200 * 1024 * 1024}\r\n\r\n"
        )
        sock.sendall(head.encode())
        received = b""
        while chunk := sock.recv(65536):  # to the end: the server closes the connection
            received += chunk
        answer = received.decode()
    assert answer.startswith("HTTP/1.1 413"), answer
    assert "request_too_large" in answer


def test_a_cancelled_batch_keeps_what_finished(sdk: openai.OpenAI) -> None:
    lines = [chat_line(f"c-{i}", f"Story {i}", max_tokens=300, ignore_eos=True) for i in range(12)]
    source = upload(sdk, lines)
    batch = sdk.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while sdk.batches.retrieve(batch.id).status == "validating":
        time.sleep(0.05)
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    ended = wait_ended(sdk, batch.id)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    answered = [*lines_of(sdk, ended.output_file_id), *lines_of(sdk, ended.error_file_id)]
    assert sorted(line["custom_id"] for line in answered) == sorted(f"c-{i}" for i in range(12))
    stopped = [line for line in answered if line["error"] is not None]
    assert stopped and all(line["error"]["code"] == "batch_cancelled" for line in stopped)
    assert sdk.batches.cancel(batch.id).status == "cancelled"
    # Its input is free to go once the batch ended.
    assert sdk.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(source.id)


@pytest.fixture(scope="module")
def chaos(
    infra: Endpoints, template_database: str, tiny_model_dir: Path
) -> Iterator[tuple[Stack, Services]]:
    env = {"TOLLGATE_BATCH_DISCOUNT": "0.5", "TOLLGATE_BATCH_IN_FLIGHT": "16"}
    with running_stack(infra, template_database, tiny_model_dir, extra_env=env) as started:
        yield started


@pytest.mark.timeout(600)
def test_a_batch_outlives_its_worker_and_driver_killed_midway(
    chaos: tuple[Stack, Services],
) -> None:
    stack, services = chaos
    key = stack.tenant_key("batches-chaos")
    sdk = openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=3)
    lines = [chat_line(f"line-{i}", f"Count to {i}", max_tokens=8) for i in range(200)]
    batch = sdk.batches.create(
        input_file_id=upload(sdk, lines).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    for name in ("worker", "admission"):
        deadline = time.monotonic() + 120
        while (counts := sdk.batches.retrieve(batch.id).request_counts) is None or (
            counts.completed < (40 if name == "worker" else 100)
        ):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        kill(services, name).restart()
    ended = wait_ended(sdk, batch.id, timeout=420)
    assert ended.status == "completed", ended
    output = lines_of(sdk, ended.output_file_id)
    errors = lines_of(sdk, ended.error_file_id)
    assert sorted(line["custom_id"] for line in [*output, *errors]) == sorted(
        f"line-{i}" for i in range(200)
    )
    assert len(output) + len(errors) == 200
    run_ids = [line["response"]["request_id"] for line in output]
    assert len(set(run_ids)) == len(run_ids)
    engine = sa.create_engine(stack.database_url.replace("postgresql://", "postgresql+psycopg://"))
    deadline = time.monotonic() + 60
    with engine.connect() as conn:
        while True:
            billed = conn.execute(
                sa.text(
                    "SELECT r.run_id, r.priority, count(e.entry_id), min(e.discount_micros)"
                    " FROM batch_lines l JOIN runs r USING (run_id)"
                    " LEFT JOIN ledger_entries e ON e.run_id = r.run_id"
                    "  AND e.billing_type = 'output_tokens'"
                    " WHERE l.batch_id = :b GROUP BY r.run_id, r.priority"
                ),
                {"b": batch.id},
            ).all()
            if all(row[2] == 1 for row in billed) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    engine.dispose()
    assert len(billed) == 200
    assert all(row[1] == "batch" and row[2] == 1 for row in billed), billed
    assert all(row[3] > 0 for row in billed if row[0] in run_ids)
    assert tollgate(["reconcile", "--database-url", stack.database_url]) == 0


def test_the_documented_example_works_when_pasted(stack: Stack, tmp_path: Path) -> None:
    pasted = paste_design_snippet("batch-snippet", stack, tmp_path)
    assert pasted.returncode == 0, pasted.stderr
    assert pasted.stdout.startswith("completed"), pasted.stdout
    # Each answer's line starts with its custom_id; an answer may hold newlines of its own.
    lines = pasted.stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines if line.startswith("colour-")] == [
        f"colour-{i}" for i in range(3)
    ]


def test_a_batch_waits_out_its_tenants_quota(stack: Stack) -> None:
    tenant = stack.admin.create_tenant(f"batches-quota-{time.monotonic_ns()}")
    key = stack.admin.create_api_key(tenant.tenant_id).secret
    stack.admin.set_quota(tenant.tenant_id, max_concurrent_runs=2)
    sdk = openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=0)
    lines = [chat_line(f"q-{i}", f"Say {i}", max_tokens=16, ignore_eos=True) for i in range(12)]
    batch = sdk.batches.create(
        input_file_id=upload(sdk, lines).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    ended = wait_ended(sdk, batch.id)
    assert ended.status == "completed", ended
    assert ended.request_counts is not None and ended.request_counts.completed == 12
    assert ended.usage is not None and ended.usage.output_tokens == 12 * 16


def test_a_batch_past_its_window_expires_keeping_what_finished(stack: Stack) -> None:
    sdk = openai.OpenAI(
        base_url=f"{stack.http}/v1", api_key=stack.tenant_key("batches-expiry"), max_retries=0
    )
    lines = [chat_line(f"e-{i}", f"Tale {i}", max_tokens=200, ignore_eos=True) for i in range(6)]
    lines += [chat_line(f"e-short-{i}", "Hi", max_tokens=2) for i in range(2)]
    batch = sdk.batches.create(
        input_file_id=upload(sdk, lines).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    while sdk.batches.retrieve(batch.id).status == "validating":
        time.sleep(0.05)
    # Its window ends now: as if a day had passed.
    engine = sa.create_engine(stack.database_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE batches SET expires_at = now() WHERE batch_id = :b"), {"b": batch.id}
        )
        conn.execute(sa.text("NOTIFY tollgate_batches"))
    engine.dispose()
    ended = wait_ended(sdk, batch.id)
    assert ended.status == "expired" and ended.expired_at is not None, ended
    output = lines_of(sdk, ended.output_file_id)
    errors = lines_of(sdk, ended.error_file_id)
    assert sorted(line["custom_id"] for line in [*output, *errors]) == sorted(
        line["custom_id"] for line in lines
    )
    assert errors and all(line["error"]["code"] == "batch_expired" for line in errors)
    assert ended.request_counts is not None and ended.request_counts.completed == len(output)
