"""Anthropic's Messages API answers (no I/O): the `message` object and stream events a
run's events make, and Anthropic's error body, which every error on its paths is given in.

A stream's events are made from the run's events by the same fold (`Completion`) as
OpenAI's chunks: several Anthropic events may come of one run event, and only the last of
them carries `id: <seq>`, so a client's `Last-Event-ID` names the last run event it has
whole, and a stream resumed after it (`Message.frames` of every event, those up to it
unsent) goes on with exactly what follows.
"""

from __future__ import annotations

import json
from typing import Any

import tollgate.types
from services.admission.http.responses import (
    Completion,
    HttpError,
    http_error,
    run_failure,
    sse_frame,
)
from services.core.errors import ApiError
from services.core.live import event_id
from services.core.runs import RunState, StoredEvent

MESSAGES_PATH = "/v1/messages"
# Anthropic's status for an overloaded API: Tollgate's UNAVAILABLE backpressure.
OVERLOADED = 529
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


def anthropic_error(answer: HttpError) -> HttpError:
    """`answer` (OpenAI's error body) told in Anthropic's body and status codes."""
    status = OVERLOADED if answer.status == 503 else answer.status
    default = "api_error" if status >= 500 else "invalid_request_error"
    error = answer.body.get("error") or {}
    message = str(error.get("message") or "")
    return HttpError(status, error_json(ERROR_TYPES.get(status, default), message), answer.headers)


def error_json(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_frame(error: ApiError) -> bytes:
    """The `error` event that ends a stream refused while it streams."""
    return sse_frame(anthropic_error(http_error(error)).body, event="error")


def shaped_for(path: str, answer: HttpError) -> HttpError:
    """The error answer as the API that `path` belongs to gives it."""
    if path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/"):
        return anthropic_error(answer)
    return answer


class Message:
    """One answer of the Messages API as its run's events tell it: the `message` object,
    or the stream's events. A run's text is held back while it may still be tool calls
    (`Completion.holds_back`); calls go as `tool_use` blocks once it ends."""

    def __init__(
        self, run_id: str, model: str, tools: bool, stop_sequences: tuple[str, ...] = ()
    ) -> None:
        self.completion = Completion(True, run_id, model, tools=tools)
        self.stop_sequences = stop_sequences
        self.input_tokens = 0
        self.reason = "stop"
        self.blocks = 0  # content blocks the stream has opened
        self.text_open = False

    def add(self, event: StoredEvent) -> None:
        """Takes in what `event` says of the answer."""
        self.completion.add(event)
        if event.kind == RunState.QUEUED:
            self.input_tokens = len(event.payload.get("prompt_token_ids") or ())
        elif event.kind == RunState.COMPLETED:
            self.reason = event.payload.get("finish_reason") or "stop"

    def body(self) -> dict[str, Any]:
        """The whole `message`, once its run completed."""
        answer = self.completion.answers[0]
        content = [_tool_use_json(call) for call in answer.tool_calls]
        if not content and answer.text:
            content = [{"type": "text", "text": answer.text}]
        return {**self._head(), "content": content, **self._stop(), "usage": self._usage()}

    def frames(self, event: StoredEvent) -> list[bytes]:
        """The stream's events that `event` adds; only the last carries its seq."""
        self.add(event)
        events = self._events(event)
        return [
            sse_frame(data, event_id(event) if i == len(events) - 1 else None, str(data["type"]))
            for i, data in enumerate(events)
        ]

    def _events(self, event: StoredEvent) -> list[dict[str, Any]]:
        if event.kind == RunState.QUEUED:
            message = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None}
            return [{"type": "message_start", "message": message | {"usage": self._usage()}}]
        if event.kind == RunState.STREAMING:
            answer = self.completion.hold(event)
            if self.completion.holds_back(answer) or not answer.held:
                return []
            text, answer.held = answer.held, ""
            return self._text_events(text)
        if event.kind == RunState.COMPLETED:
            return self._ending()
        failure = run_failure(event)
        if failure is None:
            return []
        status = 409 if event.kind == RunState.CANCELLED else 500
        return [anthropic_error(HttpError(status, failure, {})).body]

    def _text_events(self, text: str) -> list[dict[str, Any]]:
        events = []
        if not self.text_open:
            events = self._open({"type": "text", "text": ""})
            self.text_open = True
        delta = {"type": "text_delta", "text": text}
        return [*events, {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        """A content block's start; the stream's first is followed by a ping, as
        Anthropic's are."""
        self.blocks += 1
        start = {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}
        return [start, {"type": "ping"}] if self.blocks == 1 else [start]

    def _ending(self) -> list[dict[str, Any]]:
        answer = self.completion.answers[0]
        events = []
        if answer.tool_calls:
            for call in answer.tool_calls:
                events += self._open(_tool_use_json(call) | {"input": {}})
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                events.append(
                    {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}
                )
                events.append({"type": "content_block_stop", "index": self.blocks - 1})
        else:
            if answer.held:
                events += self._text_events(answer.held)
                answer.held = ""
            if self.text_open:
                events.append({"type": "content_block_stop", "index": self.blocks - 1})
        usage = {"output_tokens": self._usage()["output_tokens"]}
        events.append({"type": "message_delta", "delta": self._stop(), "usage": usage})
        return [*events, {"type": "message_stop"}]

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.completion.run_id,
            "type": "message",
            "role": "assistant",
            "model": self.completion.model,
        }

    def _stop(self) -> dict[str, Any]:
        """The stop reason, and the stop sequence when it is known which one matched."""
        if self.completion.answers[0].tool_calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        reason = STOP_REASONS.get(self.reason, "end_turn")
        matched = None
        if reason == "stop_sequence" and len(self.stop_sequences) == 1:
            matched = self.stop_sequences[0]
        return {"stop_reason": reason, "stop_sequence": matched}

    def _usage(self) -> dict[str, int]:
        usage = self.completion.usage or {}
        return {
            "input_tokens": int(usage.get("prompt_tokens", self.input_tokens)),
            "output_tokens": int(usage.get("output_tokens", 0)),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }


def _tool_use_json(call: tollgate.types.ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": json.loads(call.arguments),
    }
