"""OpenAI's Batch API without I/O: a batch input file's lines checked one by one as the
upload streams in, each line's body translated into the run it becomes, and the file and
batch objects as OpenAI's clients read them.

Every line is checked before the file is kept: a file with a bad line is refused whole,
with a 400 naming the first bad lines by number (`line 3: body.messages: ...`), so a
batch, once created, never fails for what its input said. What only running can tell (a
prompt longer than the model's context, a model the key may not use by then) ends that
line in the batch's error file instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from services.admission.batch_store import LineCounts
from services.admission.http.guard import is_nested_within
from services.admission.http.limits import DEFAULT_LIMITS, DEFAULT_MAX_BODY_BYTES, MiB
from services.admission.http.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_params,
    completion_params,
    param_names,
    param_path,
)
from services.admission.http.responses_api import (
    ResponseRequest,
    Translated,
    response_param_names,
    response_params,
)
from services.admission.requests import GenerateParams, Limits, field_violations
from services.core.errors import FieldViolation, InvalidArgument
from services.core.validation import shown

# What one input file may hold besides its bytes (`MAX_FILE_BYTES`), in docs/BATCHES.md.
MAX_LINES = 50_000
MAX_CUSTOM_ID = 512
# A line is a request's body: bounded as one sent alone is.
MAX_LINE_BYTES = DEFAULT_MAX_BODY_BYTES
# A file's bytes are kept in chunks of this size (`file_chunks`).
CHUNK_BYTES = MiB
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
COMPLETION_WINDOW = "24h"
WINDOW_SECONDS = 24 * 3600
# The Responses API's fields that have no meaning for a line of a batch.
NOT_IN_A_BATCH = ("stream", "background", "previous_response_id")


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch: its 1-based line number in the file, and what it asks."""

    number: int
    custom_id: str
    url: str
    body: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class LineRequest:
    """A line's body read as its endpoint's request, and the run it becomes."""

    body: BaseModel
    params: GenerateParams
    # OpenAI's name of each field admission's validation may report.
    names: Mapping[str, str]
    # A Responses API line's request as its Response object echoes it.
    translated: Translated | None = None


def line_request(url: str, body: Mapping[str, Any], limits: Limits) -> LineRequest:
    """The run `body` asks `url` for, as the endpoint's own route would admit it (but of
    the batch class, detached, with no key of its own yet); raises InvalidArgument naming
    the body's fields, or ValidationError for a body of the wrong shape."""
    refused = [
        FieldViolation(name, "is not supported in a batch")
        for name in NOT_IN_A_BATCH
        if body.get(name) not in (None, False)
    ]
    request, names, translate = _request(url, body, limits)
    try:
        translated = translate()
    except InvalidArgument as error:
        refused += [renamed(v, names) for v in error.violations]
    if refused:
        raise InvalidArgument(refused)
    params = translated.params if isinstance(translated, Translated) else translated
    batch_run = replace(params, priority="batch", detached=True, until_terminal=True)
    kept = translated if isinstance(translated, Translated) else None
    return LineRequest(request, batch_run, names, kept)


def _request(
    url: str, body: Mapping[str, Any], limits: Limits
) -> tuple[BaseModel, Mapping[str, str], Callable[[], GenerateParams | Translated]]:
    """The body as its endpoint's request, OpenAI's names of its fields, and how its
    route translates it."""
    if url == "/v1/responses":
        response = ResponseRequest.model_validate(body)
        names = response_param_names(response)
        return response, names, lambda: response_params(response, {}, limits)
    if url == "/v1/chat/completions":
        chat = ChatCompletionRequest.model_validate(body)
        return chat, param_names(chat), lambda: chat_params(chat, {}, limits)
    text = CompletionRequest.model_validate(body)
    return text, param_names(text), lambda: completion_params(text, {}, limits)


def renamed(violation: FieldViolation, names: Mapping[str, str]) -> FieldViolation:
    return FieldViolation(names.get(violation.field, violation.field), violation.description)


def line_key(batch_id: str, custom_id: str) -> str:
    """The idempotency key of a line's run: one run per `custom_id` of a batch, whoever
    submits it and however often."""
    return f"{batch_id}:{hashlib.sha256(custom_id.encode()).hexdigest()}"


@dataclass
class InputCheck:
    """Checks a batch input file's lines as its bytes arrive (`feed`, then `finish`),
    keeping what a batch needs to know of it: its requests (`lines`: the lines that are
    not blank), the endpoints they name, and every violation (`line N: ...`)."""

    limits: Limits
    models: Collection[str]
    max_lines: int = MAX_LINES
    max_depth: int = DEFAULT_LIMITS.max_json_depth
    lines: int = 0
    endpoints: set[str] = field(default_factory=set)
    violations: list[FieldViolation] = field(default_factory=list)
    _custom_ids: set[str] = field(default_factory=set)
    _partial: bytes = b""
    # Lines read, blank ones too: a violation names the line as an editor numbers it.
    _read: int = 0
    # Within a line refused for its length: what follows, to its end, is dropped.
    _skipping: bool = False

    def feed(self, chunk: bytes) -> None:
        *whole, partial = (self._partial + chunk).split(b"\n")
        for raw in whole:
            self._line(raw)
        if len(partial) > MAX_LINE_BYTES and not self._skipping:
            self._line(partial)  # refused for its length, not held whole
            self._skipping = True
        self._partial = b"" if self._skipping else partial

    def finish(self) -> None:
        if self._partial.strip():
            self._line(self._partial)
        self._partial = b""
        if self.lines == 0 and not self.violations:
            self.violations.append(FieldViolation("file", "holds no requests"))

    def _line(self, raw: bytes) -> None:
        if self._skipping:
            self._skipping = False
            return  # the rest of a line refused for its length
        self._read += 1
        if not raw.strip():
            return  # blank lines, and a final newline, are not requests
        self.lines += 1
        where = f"line {self._read}"
        if len(raw) > MAX_LINE_BYTES:
            why = f"line: longer than {MAX_LINE_BYTES} bytes"
            self.violations.append(FieldViolation(where, why))
            return
        if not is_nested_within(raw, self.max_depth):
            # Not JSON at all (brackets that do not pair up), or JSON nested too deep.
            why = f"line: JSON nested more than {self.max_depth} levels deep"
            if not _is_json(raw):
                why = "line: is not JSON"
            self.violations.append(FieldViolation(where, why))
            return
        if self.lines > self.max_lines:
            if self.lines == self.max_lines + 1:
                why = f"holds more than {self.max_lines} requests"
                self.violations.append(FieldViolation("file", why))
            return
        try:
            line = parse_line(raw, self.lines)
            if line.custom_id in self._custom_ids:
                raise InvalidArgument([FieldViolation("custom_id", "is not unique in the file")])
            self._custom_ids.add(line.custom_id)
            self.endpoints.add(line.url)
            request = line_request(line.url, line.body, self.limits)
            bad = field_violations(request.params, self.models, self.limits)
            if bad:
                found = [v for v in bad if v.field == "model"] or bad
                raise InvalidArgument([renamed(v, request.names) for v in found])
        except InvalidArgument as error:
            self.violations += [
                FieldViolation(where, f"{v.field}: {v.description}") for v in error.violations
            ]
        except ValidationError as error:
            self.violations += [
                FieldViolation(where, f"body.{param_path(issue['loc'])}: {issue['msg']}")
                for issue in error.errors()
            ]


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return True


def parse_line(raw: bytes, number: int) -> BatchLine:
    """A line of an input file; raises InvalidArgument naming what is wrong with it."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidArgument([FieldViolation("line", "is not JSON")]) from None
    if not isinstance(document, dict):
        raise InvalidArgument([FieldViolation("line", "is not a JSON object")])
    found = []
    custom_id, method = document.get("custom_id"), document.get("method")
    url, body = document.get("url"), document.get("body")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        found.append(FieldViolation("custom_id", f"must be 1 to {MAX_CUSTOM_ID} characters"))
    if method != "POST":
        found.append(FieldViolation("method", "must be POST"))
    if url not in ENDPOINTS:
        found.append(FieldViolation("url", f"must be one of {', '.join(ENDPOINTS)}"))
    if not isinstance(body, dict):
        found.append(FieldViolation("body", "must be a JSON object"))
    if found:
        raise InvalidArgument(found)
    assert isinstance(body, dict)
    return BatchLine(number, str(custom_id), str(url), body)


def file_object(row: Mapping[Any, Any]) -> dict[str, Any]:
    """OpenAI's file object for a `files` row."""
    return {
        "id": row["file_id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": _seconds(row["created_at"]),
        "expires_at": None,
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }


def batch_object(row: Mapping[Any, Any], counts: LineCounts | None) -> dict[str, Any]:
    """OpenAI's batch object for a `batches` row, with its lines' counts and tokens."""
    counts = counts or LineCounts()
    moments = (
        "created_at",
        "in_progress_at",
        "expires_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    )
    errors = row["errors"]
    return {
        "id": row["batch_id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        **{moment: _seconds(row[moment]) for moment in moments},
        "request_counts": {
            "total": row["total"],
            "completed": counts.completed,
            "failed": counts.failed,
        },
        "usage": {
            "input_tokens": counts.prompt_tokens,
            "input_tokens_details": {"cached_tokens": counts.cached_prompt_tokens},
            "output_tokens": counts.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.prompt_tokens + counts.output_tokens,
        },
        "metadata": row["metadata"],
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def metadata_violations(metadata: Mapping[str, Any] | None) -> list[FieldViolation]:
    """OpenAI's bounds on `metadata`: 16 pairs, keys of 64 and values of 512 characters."""
    if metadata is None:
        return []
    if len(metadata) > 16:
        return [FieldViolation("metadata", "holds more than 16 pairs")]
    return [
        FieldViolation(f"metadata.{shown(str(key))}", "must be a string of at most 512 characters")
        for key, value in metadata.items()
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512
    ]


def _seconds(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())
