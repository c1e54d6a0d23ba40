"""The Batch API's pure halves: an input file's lines checked as its bytes arrive, however
they are cut; a line's body into the batch-class run it becomes; a line's run into its
line of the output or error file; and the file and batch objects, checked against the
`openai` SDK's types."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import openai.types
import pytest

from services.admission.batch_store import LineCounts
from services.admission.http.answers import (
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    answered_line,
    stopped_line,
)
from services.admission.http.batches_api import (
    MAX_LINE_BYTES,
    BatchLine,
    InputCheck,
    batch_object,
    file_object,
    line_key,
    line_request,
    metadata_violations,
    parse_line,
)
from services.admission.requests import Limits
from services.core.errors import InvalidArgument
from services.core.runs import RunState, StoredEvent
from tests.openai_types import parse_response, unknown_fields

LIMITS = Limits(max_tokens=4096, default_disconnect_grace=30.0)
T0 = datetime(2026, 1, 1, tzinfo=UTC)
USAGE = {"prompt_tokens": 7, "cached_prompt_tokens": 2, "output_tokens": 3}


def chat(custom_id: str = "a", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
    }


def jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def checked(data: bytes, cut: int = 0, max_lines: int = 50_000) -> InputCheck:
    check = InputCheck(LIMITS, ["m"], max_lines=max_lines)
    pieces = [data[i : i + cut] for i in range(0, len(data), cut)] if cut else [data]
    for piece in pieces:
        check.feed(piece)
    check.finish()
    return check


def test_a_good_file_is_counted_however_its_bytes_are_cut() -> None:
    completion = {
        "custom_id": "t",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "Once"},
    }
    data = jsonl(chat("a"), chat("b\u00e9"), completion) + b"\n  \n"
    for cut in (0, 1, 2, 7, 64):
        check = checked(data.rstrip(b"\n"), cut)  # the last line without its newline too
        assert check.violations == [], cut
        assert check.lines == 3
        assert check.endpoints == {"/v1/chat/completions", "/v1/completions"}


def test_every_bad_line_is_named_by_its_number() -> None:
    data = (
        jsonl(chat("a"), chat("a"), chat("b", max_tokens=0), chat("c", model="nope"))
        + b"[1]\n{not json\n"
        + jsonl(
            {"custom_id": "", "method": "GET", "url": "/v1/embeddings", "body": []},
            chat("d", stream=True),
            chat("e", messages="hi"),
        )
    )
    found = [f"{v.field}: {v.description}" for v in checked(data).violations]
    assert found[0] == "line 2: custom_id: is not unique in the file"
    assert found[1].startswith("line 3: max_tokens: ")
    assert found[2].startswith("line 4: model: unknown model")
    assert found[3] == "line 5: line: is not a JSON object"
    assert found[4] == "line 6: line: is not JSON"
    assert [f.split(":")[1].strip() for f in found[5:9]] == ["custom_id", "method", "url", "body"]
    assert found[9] == "line 8: stream: is not supported in a batch"
    assert found[10].startswith("line 9: body.messages: ")
    assert not any(f.startswith("line 1:") for f in found)


def test_a_bad_line_is_numbered_as_an_editor_numbers_it() -> None:
    data = b"\n" + jsonl(chat("a")) + b"  \n" + jsonl(chat("b", max_tokens=0))
    [bad] = checked(data).violations
    assert bad.field == "line 4"


def test_a_line_too_long_or_too_deep_is_refused_without_being_held() -> None:
    deep = {"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {}}
    nested: Any = "x"
    for _ in range(100):
        nested = [nested]
    deep["body"] = {"model": "m", "prompt": "p", "logit_bias": {"1": nested}}
    data = jsonl(chat("a")) + b"x" * (MAX_LINE_BYTES + 10) + b"\n" + jsonl(deep, chat("b"))
    check = checked(data, cut=1 << 20)
    assert [v.field for v in check.violations] == ["line 2", "line 3"]
    assert check.lines == 4 and len(check._partial) == 0


def test_an_empty_file_and_one_of_too_many_lines_are_refused() -> None:
    assert [v.field for v in checked(b"\n\n").violations] == ["file"]
    over = checked(jsonl(*(chat(str(i)) for i in range(4))), max_lines=3)
    assert [(v.field, v.description) for v in over.violations] == [
        ("file", "holds more than 3 requests")
    ]


def test_a_line_becomes_a_detached_batch_run() -> None:
    request = line_request("/v1/chat/completions", chat()["body"], LIMITS)
    params = request.params
    assert (params.priority, params.detached, params.until_terminal) == ("batch", True, True)
    assert params.messages[0].content == "hi" and params.idempotency_key == ""
    responses = line_request("/v1/responses", {"model": "m", "input": "hi"}, LIMITS)
    assert responses.translated is not None and responses.params.priority == "batch"
    with pytest.raises(InvalidArgument) as refused:
        line_request(
            "/v1/responses", {"model": "m", "input": "hi", "previous_response_id": "r"}, LIMITS
        )
    assert [v.field for v in refused.value.violations] == ["previous_response_id"]
    response_line = {
        "custom_id": "r",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": "m", "input": "hi", "max_output_tokens": 0},
    }
    [renamed] = checked(jsonl(response_line)).violations
    assert renamed.description.startswith("max_output_tokens: ")


def test_a_lines_run_is_named_by_its_batch_and_custom_id() -> None:
    assert line_key("batch_1", "a") == line_key("batch_1", "a")
    assert len({line_key("batch_1", "a"), line_key("batch_1", "b"), line_key("batch_2", "a")}) == 3
    assert len(line_key("batch_" + "f" * 32, "x" * 512)) < 256


def events(run_id: str, *kinds: tuple[RunState, dict[str, Any]]) -> list[StoredEvent]:
    return [
        StoredEvent(run_id, seq, kind, "t1", payload, T0 + timedelta(seconds=seq))
        for seq, (kind, payload) in enumerate(kinds, start=1)
    ]


def answer(url: str, body: dict[str, Any], *kinds: Any, stopped: str = "") -> Any:
    line = BatchLine(1, "c1", url, body)
    request = line_request(url, body, LIMITS)
    ran = events("run_1", *kinds)
    return answered_line("batch_1", line, request, "run_1", "t1", ran, lambda t: b"", stopped)


def test_a_completed_run_is_a_line_of_the_output_file() -> None:
    done, line = answer(
        "/v1/chat/completions",
        chat()["body"],
        (RunState.QUEUED, {}),
        (RunState.STREAMING, {"text": "Hello"}),
        (RunState.COMPLETED, {"finish_reason": "stop", "usage": USAGE}),
    )
    assert done and line["custom_id"] == "c1" and line["error"] is None
    assert line["id"].startswith("batch_req_")
    response = line["response"]
    assert (response["status_code"], response["request_id"]) == (200, "run_1")
    body = openai.types.chat.ChatCompletion.model_validate(response["body"])
    assert body.choices[0].message.content == "Hello"
    assert body.usage is not None and body.usage.completion_tokens == 3


def test_a_responses_line_answers_with_a_response_object() -> None:
    done, line = answer(
        "/v1/responses",
        {"model": "m", "input": "hi", "instructions": "Be brief"},
        (RunState.QUEUED, {}),
        (RunState.STREAMING, {"text": "Hi"}),
        (RunState.COMPLETED, {"finish_reason": "stop", "usage": USAGE}),
    )
    assert done
    response = parse_response(line["response"]["body"])
    assert response.output_text == "Hi" and response.instructions == "Be brief"


def test_failed_and_stopped_runs_are_lines_of_the_error_file() -> None:
    failed = (RunState.FAILED, {"code": "ENGINE_ERROR", "message": "gone"})
    done, line = answer("/v1/chat/completions", chat()["body"], (RunState.QUEUED, {}), failed)
    assert not done and line["response"]["status_code"] == 500
    assert line["response"]["body"]["error"]["code"] == "ENGINE_ERROR"
    cancelled = (RunState.CANCELLED, {"reason": "batch cancelled"})
    for stopped in (BATCH_CANCELLED, BATCH_EXPIRED):
        done, line = answer(
            "/v1/chat/completions",
            chat()["body"],
            (RunState.QUEUED, {}),
            cancelled,
            stopped=stopped,
        )
        assert not done and line["response"] is None and line["error"]["code"] == stopped
    # Cancelled on its own (its run's cancel route), in a batch that went on.
    done, line = answer("/v1/chat/completions", chat()["body"], (RunState.QUEUED, {}), cancelled)
    assert not done and line["response"]["status_code"] == 409
    never = stopped_line("batch_1", "c2", BATCH_EXPIRED)
    assert never["error"]["message"] and never["id"] != line["id"]


def test_the_objects_are_the_sdks() -> None:
    moment = datetime(2026, 12, 1, tzinfo=UTC)
    file = openai.types.FileObject.model_validate(
        file_object(
            {
                "file_id": "file-1",
                "bytes": 10,
                "created_at": moment,
                "filename": "in.jsonl",
                "purpose": "batch",
            }
        )
    )
    assert unknown_fields(file) == [] and file.created_at == int(moment.timestamp())
    row = {
        "batch_id": "batch_1",
        "endpoint": "/v1/chat/completions",
        "errors": None,
        "input_file_id": "file-1",
        "completion_window": "24h",
        "status": "in_progress",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": moment,
        "expires_at": moment + timedelta(days=1),
        "total": 5,
        "metadata": {"k": "v"},
        **dict.fromkeys(
            (
                "in_progress_at",
                "finalizing_at",
                "completed_at",
                "failed_at",
                "expired_at",
                "cancelling_at",
                "cancelled_at",
            )
        ),
    }
    counts = LineCounts(4, 3, 2, 1, 70, 20, 30)
    batch = openai.types.Batch.model_validate(batch_object(row, counts))
    assert unknown_fields(batch) == []
    assert batch.request_counts is not None and batch.request_counts.total == 5
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    assert batch.usage is not None and batch.usage.total_tokens == 100
    empty = openai.types.Batch.model_validate(batch_object(row, None))
    assert empty.request_counts is not None and empty.request_counts.completed == 0


def test_metadata_is_bounded_as_openai_bounds_it() -> None:
    assert metadata_violations(None) == metadata_violations({"k": "v"}) == []
    assert [v.field for v in metadata_violations({str(i): "v" for i in range(17)})] == ["metadata"]
    assert len(metadata_violations({"k" * 65: "v", "a": "v" * 513, "b": 1})) == 3


def test_parse_line_keeps_what_the_line_asks() -> None:
    line = parse_line(json.dumps(chat("x")).encode(), 7)
    assert (line.number, line.custom_id, line.url) == (7, "x", "/v1/chat/completions")
