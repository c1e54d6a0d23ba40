"""OpenAI-style answers: completion bodies, stream chunks, server-sent-event frames and
error bodies, made from admission's run events and API errors (no I/O).

Every frame of a streamed completion carries `id: <seq>` of the run event it came from,
so a client that lost its connection resumes from `GET /v1/runs/{run_id}/events` with
`Last-Event-ID` and receives exactly the events it missed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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
from services.core.live import event_id
from services.core.runs import RunState, RunView, StoredEvent
from tollgate.structure import may_open_calls, tool_calls_of
from tollgate.types import ToolCall
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


def sse_frame(data: Mapping[str, Any], seq: int | str | None = None, event: str = "") -> bytes:
    """An SSE frame; `seq` is its id: a stored event's seq, or a live event's position."""
    head = f"event: {event}\n" if event else ""
    head += f"id: {seq}\n" if seq is not None else ""
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


# A token id -> the bytes it stands for (the model's tokenizer).
TokenBytes = Callable[[int], bytes]


@dataclass(slots=True)
class Answer:
    """One choice of a completion, as far as its run's events have told it."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: list[Mapping[str, Any]] = field(default_factory=list)
    # Streaming: the text and logprobs not sent yet while it may still be a call.
    held: str = ""
    held_logprobs: list[Mapping[str, Any]] = field(default_factory=list)
    text_offset: int = 0
    # Streaming: its finish reason has been sent.
    sent_end: bool = False


@dataclass(slots=True)
class Completion:
    """One completion as it is streamed or answered whole: chat or text, with `n` choices.

    With `tools`, an answer that may open calls (`may_open_calls`) is held back until it ends, then given as
    OpenAI's `tool_calls` (finish reason "tool_calls") when it parses as calls, else as the
    text it is. With `token_bytes`, each token's logprobs go with its text. With `echo`
    (the completions endpoint's prompt), each choice's text starts with the prompt, and its
    logprobs with the prompt's (the first token's null), which the run's first `streaming`
    event brings. A choice ends with the `streaming` event that says so (n > 1) or with
    the run's `completed`.
    """

    chat: bool
    run_id: str
    model: str
    include_usage: bool = False
    tools: bool = False
    token_bytes: TokenBytes | None = None
    n: int = 1
    echo: str | None = None
    created: int = 0
    usage: Mapping[str, Any] | None = None
    answers: list[Answer] = field(default_factory=list)
    first_prompt_token: int = 0

    def __post_init__(self) -> None:
        self.answers = [Answer(i) for i in range(self.n)]
        for answer in self.answers:
            answer.text = answer.held = self.echo or ""

    def frames(self, event: StoredEvent) -> list[bytes]:
        """The SSE frames `event` adds to the stream (none for most bookkeeping events)."""
        self.add(event)
        seq = event_id(event)
        if event.kind == RunState.QUEUED:
            # A chat stream opens with the assistant's role, as OpenAI's does.
            if not self.chat:
                return []
            delta = {"role": "assistant", "content": ""}
            return [sse_frame(self._chunk(a, delta), seq) for a in self.answers]
        if event.kind == RunState.STREAMING:
            answer = self.hold(event)
            if answer.finish_reason is not None:
                return [sse_frame(chunk, seq) for chunk in self._ending(answer)]
            if self.holds_back(answer):
                return []  # a call, maybe: held until the answer ends
            # Even without text (a character still incomplete), so that its seq is seen.
            return [sse_frame(self._text_chunk(answer), seq)]
        if event.kind == RunState.COMPLETED:
            chunks = [c for a in self.answers if not a.sent_end for c in self._ending(a)]
            if self.include_usage:
                chunks.append(self._usage_chunk())
            return [*(sse_frame(c, seq) for c in chunks), DONE]
        failure = run_failure(event)
        return [sse_frame(failure, seq), DONE] if failure else []

    def body(self) -> dict[str, Any]:
        """The whole completion, once its run completed."""
        choices = [self._choice(answer) for answer in self.answers]
        return {**self._head(), "choices": choices, "usage": usage_body(self.usage or {})}

    def hold(self, event: StoredEvent) -> Answer:
        """The answer a `streaming` event (already `add`ed) adds to, its text and logprobs
        held until a stream sends them."""
        answer = self._answer(event)
        answer.held += event.payload.get("text", "")
        answer.held_logprobs += event.payload.get("logprobs", [])
        return answer

    def holds_back(self, answer: Answer) -> bool:
        """Whether a stream keeps the answer's held text back: it may still be calls, which
        go once the answer ends."""
        return self.tools and may_open_calls(answer.held)

    def add(self, event: StoredEvent) -> None:
        """Takes in what `event` says of the answer."""
        if event.kind == RunState.QUEUED:
            self.created = int(event.created_at.timestamp())
            self.first_prompt_token = int((event.payload.get("prompt_token_ids") or [0])[0])
        elif event.kind == RunState.STREAMING:
            if event.payload.get("prompt_logprobs"):
                self._echo_logprobs(event.payload["prompt_logprobs"])
            answer = self._answer(event)
            answer.text += event.payload.get("text", "")
            answer.logprobs += event.payload.get("logprobs", [])
            if event.payload.get("finish_reason"):
                self._end(answer, event.payload["finish_reason"])
        elif event.kind == RunState.COMPLETED:
            reason = event.payload.get("finish_reason") or "stop"
            self.usage = event.payload.get("usage", {})
            for answer in self.answers:
                if answer.finish_reason is None:
                    self._end(answer, reason)

    def _echo_logprobs(self, scored: list[Mapping[str, Any]]) -> None:
        """Each choice's logprobs start with the prompt's: its first token has none."""
        entries = [{"token_id": self.first_prompt_token, "logprob": None}, *scored]
        for answer in self.answers:
            answer.logprobs[:0] = entries
            answer.held_logprobs[:0] = entries

    def _answer(self, event: StoredEvent) -> Answer:
        index = int(event.payload.get("index", 0))
        return self.answers[index] if 0 <= index < len(self.answers) else self.answers[0]

    def _end(self, answer: Answer, reason: str) -> None:
        answer.finish_reason = FINISH_REASONS.get(reason, reason)
        # Each choice's calls get ids of their own.
        key = self.run_id if answer.index == 0 else f"{self.run_id}:{answer.index}"
        calls = tool_calls_of(answer.text, key) if self.tools else None
        if calls and reason == "stop":
            answer.tool_calls, answer.finish_reason = calls, "tool_calls"

    def _ending(self, answer: Answer) -> list[dict[str, Any]]:
        """The chunks that end a choice: what it held back, then its finish reason."""
        if answer.tool_calls:
            calls = [_call_json(i, c) for i, c in enumerate(answer.tool_calls)]
            chunks = [self._chunk(answer, {"tool_calls": calls})]
        else:
            chunks = [self._text_chunk(answer)] if answer.held else []
        chunks.append(self._chunk(answer, {}, finish_reason=answer.finish_reason))
        answer.sent_end = True
        return chunks

    def _choice(self, answer: Answer) -> dict[str, Any]:
        logprobs = self._logprobs(answer, answer.logprobs) if not answer.tool_calls else None
        if self.chat and answer.tool_calls:
            calls = [_call_json(i, c) for i, c in enumerate(answer.tool_calls)]
            for call in calls:
                del call["index"]
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            choice: dict[str, Any] = {"index": answer.index, "message": message}
        elif self.chat:
            message = {"role": "assistant", "content": answer.text}
            choice = {"index": answer.index, "message": message}
        else:
            choice = {"index": answer.index, "text": answer.text}
        return choice | {"logprobs": logprobs, "finish_reason": answer.finish_reason}

    def _text_chunk(self, answer: Answer) -> dict[str, Any]:
        """The held text and its logprobs, which it sends."""
        text, answer.held = answer.held, ""
        logprobs = self._logprobs(answer, answer.held_logprobs)
        answer.held_logprobs = []
        return self._chunk(answer, {"content": text}, text=text, logprobs=logprobs)

    def _logprobs(self, answer: Answer, entries: list[Mapping[str, Any]]) -> dict[str, Any] | None:
        """OpenAI's logprobs object for `entries` (the `streaming` events' TokenLogprob
        JSON); None when the run asked for none."""
        if self.token_bytes is None:
            return None
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens, offsets = [], []
        for entry in entries:
            tokens.append(self._piece(entry)["token"])
            offsets.append(answer.text_offset)
            answer.text_offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [_logprob(e) for e in entries],
            "top_logprobs": [
                None
                if _logprob(e) is None
                else {self._piece(t)["token"]: _logprob(t) for t in e.get("top", [])}
                for e in entries
            ],
            "text_offset": offsets,
        }

    def _chat_logprob(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        top = [self._piece(t) | {"logprob": _logprob(t)} for t in entry.get("top", [])]
        return self._piece(entry) | {"logprob": _logprob(entry), "top_logprobs": top}

    def _piece(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        assert self.token_bytes is not None
        raw = self.token_bytes(int(entry.get("token_id", 0)))
        return {"token": raw.decode(errors="replace"), "bytes": list(raw)}

    def _head(self) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.run_id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(
        self,
        answer: Answer,
        delta: dict[str, Any],
        text: str = "",
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        head = self._head()
        if self.chat:
            head["object"] = "chat.completion.chunk"
            choice = {"index": answer.index, "delta": delta}
        else:
            choice = {"index": answer.index, "text": text}
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        return {**head, "choices": [choice]}

    def _usage_chunk(self) -> dict[str, Any]:
        head = self._head()
        if self.chat:
            head["object"] = "chat.completion.chunk"
        return {**head, "choices": [], "usage": usage_body(self.usage or {})}


def _call_json(index: int, call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"index": index, "id": call.id, "type": "function", "function": function}


def _logprob(entry: Mapping[str, Any]) -> float | None:
    """None for an echoed prompt's first token, which has no logprob."""
    # proto3's JSON leaves a zero out.
    logprob = entry.get("logprob", 0.0)
    return None if logprob is None else float(logprob)


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
        **({"live": True} if event.live else {}),
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
