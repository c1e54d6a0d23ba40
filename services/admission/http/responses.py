"""OpenAI-style answers: completion bodies, stream chunks, server-sent-event frames and
error bodies, made from admission's run events and API errors (no I/O).

Every frame of a streamed completion carries `id: <seq>` of the run event it came from,
so a client that lost its connection resumes from `GET /v1/runs/{run_id}/events` with
`Last-Event-ID` and receives exactly the events it missed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from services.core.codec import PROTO_STATES, rfc3339
from services.core.errors import (
    ApiError,
    FailedPrecondition,
    IdempotencyKeyReused,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    Unavailable,
)
from services.core.runs import RunState, RunView, StoredEvent
from tollgate.v1 import events_pb2

DONE = b"data: [DONE]\n\n"
# The engine says why a sequence ended; OpenAI's clients know "stop" and "length".
FINISH_REASONS = {"stop_sequence": "stop"}

# An API error's status code -> (HTTP status, OpenAI error type).
STATUSES: Mapping[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "FAILED_PRECONDITION": (409, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
}


@dataclass(frozen=True, slots=True)
class HttpError:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def http_error(error: ApiError, param_names: Mapping[str, str] | None = None) -> HttpError:
    """The HTTP status, OpenAI error body and headers that tell a client of `error`."""
    status, error_type = STATUSES.get(error.code, (500, "server_error"))
    message, param = error.message, None
    code: str | None = error.code.lower()
    headers = {}
    if isinstance(error, InvalidArgument):
        names = param_names or {}
        params = [names.get(v.field, v.field) for v in error.violations]
        message = "; ".join(
            f"{p}: {v.description}" for p, v in zip(params, error.violations, strict=True)
        )
        param = params[0] if params else None
    elif isinstance(error, PermissionDenied):
        param = error.field or None
        code = error.reason.lower() or code
    elif isinstance(error, FailedPrecondition):
        code = error.reason.lower()
        if isinstance(error, IdempotencyKeyReused):
            message = "the Idempotency-Key already names a different request"
            param = "Idempotency-Key"
            headers["x-request-id"] = error.metadata["run_id"]
    if isinstance(error, QuotaExceeded | Unavailable):
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after)))
    if status == 500:
        message, code = "internal error", None
    return HttpError(status, error_body(message, error_type, param, code), headers)


def sse_frame(data: Mapping[str, Any], seq: int | None = None) -> bytes:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def run_failure(event: StoredEvent) -> dict[str, Any] | None:
    """The error body of a run that ended failed or cancelled; None for other events."""
    if event.kind == RunState.FAILED:
        code = event.payload.get("code") or "INTERNAL"
        message = event.payload.get("message") or "the run failed"
        return error_body(message, "server_error", None, code)
    if event.kind == RunState.CANCELLED:
        reason = event.payload.get("reason") or "the run was cancelled"
        return error_body(reason, "cancelled", None, "cancelled")
    return None


def usage_body(usage: Mapping[str, Any]) -> dict[str, Any]:
    prompt = int(usage.get("prompt_tokens", 0))
    output = int(usage.get("output_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_prompt_tokens", 0))},
    }


@dataclass(slots=True)
class Completion:
    """One completion as it is streamed or answered whole: chat or text."""

    chat: bool
    run_id: str
    model: str
    include_usage: bool = False
    created: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None

    def frames(self, event: StoredEvent) -> list[bytes]:
        """The SSE frames `event` adds to the stream (none for most bookkeeping events)."""
        self.add(event)
        seq = event.seq
        if event.kind == RunState.QUEUED:
            # A chat stream opens with the assistant's role, as OpenAI's does.
            if not self.chat:
                return []
            return [sse_frame(self._chunk({"role": "assistant", "content": ""}), seq)]
        if event.kind == RunState.STREAMING:
            # Even without text (a character still incomplete), so that its seq is seen.
            text = event.payload.get("text", "")
            return [sse_frame(self._chunk({"content": text}, text=text), seq)]
        if event.kind == RunState.COMPLETED:
            frames = [sse_frame(self._chunk({}, finish_reason=self.finish_reason), seq)]
            if self.include_usage:
                frames.append(sse_frame(self._usage_chunk(), seq))
            return [*frames, DONE]
        failure = run_failure(event)
        return [sse_frame(failure, seq), DONE] if failure else []

    def body(self) -> dict[str, Any]:
        """The whole completion, once its run completed."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}}
        else:
            choice = {"index": 0, "text": self.text}
        choice |= {"logprobs": None, "finish_reason": self.finish_reason}
        return {**self._head(), "choices": [choice], "usage": usage_body(self.usage or {})}

    def add(self, event: StoredEvent) -> None:
        """Takes in what `event` says of the answer."""
        if event.kind == RunState.QUEUED:
            self.created = int(event.created_at.timestamp())
        elif event.kind == RunState.STREAMING:
            self.text += event.payload.get("text", "")
        elif event.kind == RunState.COMPLETED:
            reason = event.payload.get("finish_reason") or "stop"
            self.finish_reason = FINISH_REASONS.get(reason, reason)
            self.usage = event.payload.get("usage", {})

    def _head(self) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.run_id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(
        self, delta: dict[str, Any], text: str = "", finish_reason: str | None = None
    ) -> dict[str, Any]:
        head = self._head()
        if self.chat:
            head["object"] = "chat.completion.chunk"
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        return {**head, "choices": [choice]}

    def _usage_chunk(self) -> dict[str, Any]:
        head = self._head()
        if self.chat:
            head["object"] = "chat.completion.chunk"
        return {**head, "choices": [], "usage": usage_body(self.usage or {})}


def timestamp(moment: datetime | None) -> str | None:
    return rfc3339(moment) if moment is not None else None


def state_name(state: RunState | None) -> str:
    return events_pb2.RunState.Name(PROTO_STATES[state] if state else 0)  # type: ignore[arg-type]


def event_json(event: StoredEvent) -> dict[str, Any]:
    """A run event in the JSON form of `RunEvent` (proto field names, integers as numbers)."""
    return {
        "run_id": event.run_id,
        "seq": event.seq,
        "state": state_name(event.kind),
        "tenant_id": event.tenant_id,
        "time": timestamp(event.created_at),
        str(event.kind): dict(event.payload),
    }


def run_json(run: RunView) -> dict[str, Any]:
    """A run in the JSON form of `Run` (proto field names, integers as numbers)."""
    priority = events_pb2.PRIORITY_BATCH if run.priority == "batch" else 1
    return {
        "run_id": run.run_id,
        "tenant_id": run.tenant_id,
        "model": run.model,
        "state": state_name(run.state),
        "last_seq": run.last_seq,
        "usage": dict(run.usage),
        "idempotency_key": run.idempotency_key or "",
        "finish_reason": run.finish_reason or "",
        "create_time": timestamp(run.created_at),
        "update_time": timestamp(run.updated_at),
        "priority": events_pb2.Priority.Name(priority),  # type: ignore[arg-type]
    }
