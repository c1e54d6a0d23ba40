"""A response as its run's stored events tell it: OpenAI's Response object and the
numbered events of its stream (no I/O).

`ResponseView` is a pure translator, stored events in, Responses events out. One stored
event may become several Responses events (the `queued` event is `response.created`
and `response.queued`; the `completed` event closes the output items, then is
`response.completed`), and some none (`billed`). Events are numbered by where they stand
in the response: an event's `sequence_number` is the number of events before it that
are not text deltas, plus the characters of text sent before it (a delta: up to its
last character). So the numbers go up, and are the same whatever pieces the text came in: a live stream sends tokens as
they are made (`services.core.live`), a replay from the store in bigger pieces. A stream
resumed after N replays from the start and drops what a client with N has, cutting the
delta N falls inside (`past`). The answer's text, the calls it holds back and its usage
come from the chat endpoint's `Completion`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.structure import ToolCall as EngineToolCall
from services.admission.http.responses import Completion
from services.admission.http.responses_api import response_id_of
from services.admission.requests import ChatTurn
from services.admission.response_store import ResponseRecord
from services.core.runs import RunState, StoredEvent
from tollgate.types import ToolCall

# The request's fields that the Response object gives back as they were sent.
ECHOED = (
    "background",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_p",
    "user",
)
ENDED = frozenset({"completed", "incomplete", "failed", "cancelled"})
TEXT_DELTA = "response.output_text.delta"


@dataclass(slots=True)
class ResponseView:
    """One response as far as its run's events have told it."""

    record: ResponseRecord
    model: str
    status: str = "queued"
    created_at: float = 0.0
    completed_at: float | None = None
    error: dict[str, Any] | None = None
    usage: Mapping[str, Any] | None = None
    # The events numbered so far that are not text deltas, and the text the deltas sent.
    num_others: int = 0
    num_chars: int = 0
    announced: bool = False
    message_open: bool = False
    # The answer's text streamed so far.
    released: str = ""
    completion: Completion = field(init=False)

    def __post_init__(self) -> None:
        tools = bool(self.record.request.get("tools"))
        self.completion = Completion(True, self.record.run_id, self.model, tools=tools)
        if self.record.created_at is not None:
            self.created_at = self.record.created_at.timestamp()

    @property
    def id(self) -> str:
        return response_id_of(self.record.run_id)

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def events(self, event: StoredEvent) -> list[dict[str, Any]]:
        """The Responses events `event` adds, numbered on from the ones before it."""
        numbered = []
        for translated in self._translate(event):
            if translated["type"] == TEXT_DELTA:
                self.num_chars += len(translated["delta"])
                number = self.num_others + self.num_chars - 1
            else:
                number = self.num_others + self.num_chars
                self.num_others += 1
            numbered.append({**translated, "sequence_number": number})
        return numbered

    def body(self) -> dict[str, Any]:
        """The Response object as it stands."""
        request = self.record.request
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "completed_at": self.completed_at,
            "error": self.error,
            "incomplete_details": incomplete,
            "metadata": request.get("metadata") or {},
            "model": self.model,
            "output": self._output(),
            "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
            "truncation": "disabled",
            "usage": _usage(self.usage) if self.usage is not None else None,
            **{name: request.get(name) for name in ECHOED},
        }

    def _translate(self, event: StoredEvent) -> list[dict[str, Any]]:
        self.completion.add(event)
        if event.kind == RunState.QUEUED:
            self.status = "queued"
            if self.num_others:
                return []  # queued again, having streamed nothing
            self.created_at = event.created_at.timestamp()
            return [self._whole("response.created"), self._whole("response.queued")]
        if event.kind in (RunState.PREFILL, RunState.STREAMING):
            self.status = "in_progress"
            out = [] if self.announced else [self._whole("response.in_progress")]
            self.announced = True
            if event.kind == RunState.STREAMING:
                answer = self.completion.hold(event)
                if not self.completion.holds_back(answer):
                    out += self._release()
            return out
        if event.kind == RunState.COMPLETED:
            self.completed_at = event.created_at.timestamp()
            self.usage = event.payload.get("usage", {})
            length = self.completion.answers[0].finish_reason == "length"
            self.status = "incomplete" if length else "completed"
            return [*self._finish(), self._whole(f"response.{self.status}")]
        if event.kind in (RunState.FAILED, RunState.CANCELLED):
            self.usage = event.payload.get("usage", {})
            if event.kind == RunState.CANCELLED:
                self.status = "cancelled"
                return []  # OpenAI's stream of a cancelled response just ends
            self.status = "failed"
            message = event.payload.get("message") or "the run failed"
            self.error = {"code": "server_error", "message": message}
            return [self._whole("response.failed")]
        return []

    def _whole(self, kind: str) -> dict[str, Any]:
        return {"type": kind, "response": self.body()}

    def _release(self) -> list[dict[str, Any]]:
        """The text the answer held back, as a delta (after the message's opening)."""
        answer = self.completion.answers[0]
        text, answer.held, answer.held_logprobs = answer.held, "", []
        if not text:
            return []
        self.released += text
        return [
            *self._open(),
            {
                "type": TEXT_DELTA,
                **self._part_of(),
                "delta": text,
                "logprobs": [],
            },
        ]

    def _open(self) -> list[dict[str, Any]]:
        if self.message_open:
            return []
        self.message_open = True
        item = self._message("in_progress", None)
        part = {**self._part_of(), "part": _text_part("")}
        return [
            {"type": "response.output_item.added", "output_index": 0, "item": item},
            {"type": "response.content_part.added", **part},
        ]

    def _finish(self) -> list[dict[str, Any]]:
        """The events that close the answer: its held text and the message, or its calls."""
        calls = self.completion.answers[0].tool_calls
        if calls and not self.message_open:
            items = enumerate(self._call_item(i, c) for i, c in enumerate(calls))
            return [e for index, item in items for e in _call_events(index, item)]
        out = [*self._release(), *self._open()]
        text = self.released
        item = self._message(self._item_status(), text)
        return [
            *out,
            {"type": "response.output_text.done", **self._part_of(), "text": text, "logprobs": []},
            {"type": "response.content_part.done", **self._part_of(), "part": _text_part(text)},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
        ]

    def _output(self) -> list[dict[str, Any]]:
        calls = self.completion.answers[0].tool_calls
        if calls and not self.message_open and self.ended:
            return [self._call_item(i, call) for i, call in enumerate(calls)]
        if self.message_open:
            return [self._message(self._item_status(), self.released)]
        return []

    def _item_status(self) -> str:
        if self.status == "completed":
            return "completed"
        return "incomplete" if self.ended else "in_progress"

    def _message(self, status: str, text: str | None) -> dict[str, Any]:
        return {
            "id": self._message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [] if text is None else [_text_part(text)],
        }

    def _call_item(self, index: int, call: ToolCall) -> dict[str, Any]:
        return {
            "id": f"fc_{self.record.run_id.removeprefix('run_')}_{index}",
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }

    @property
    def _message_id(self) -> str:
        return f"msg_{self.record.run_id.removeprefix('run_')}"

    def _part_of(self) -> dict[str, Any]:
        return {"item_id": self._message_id, "output_index": 0, "content_index": 0}


def replay(
    record: ResponseRecord, model: str, events: Iterable[StoredEvent], after: int = -1
) -> tuple[ResponseView, list[dict[str, Any]]]:
    """The view after `events`, and their Responses events past `after`."""
    view = ResponseView(record, model)
    return view, past((e for event in events for e in view.events(event)), after)


def past(events: Iterable[dict[str, Any]], after: int) -> list[dict[str, Any]]:
    """What a client that has the events up to `after` lacks of `events`: those numbered
    past it, the text delta it falls inside cut to the text after it."""
    out = []
    for event in events:
        number = event["sequence_number"]
        if number <= after:
            continue
        if event["type"] == TEXT_DELTA and number - len(event["delta"]) < after:
            event = {**event, "delta": event["delta"][after - number :]}
        out.append(event)
    return out


def _call_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """One function call's events: opened, its arguments whole, closed."""
    at = {"item_id": item["id"], "output_index": index}
    opened = {**item, "arguments": "", "status": "in_progress"}
    arguments = item["arguments"]
    return [
        {"type": "response.output_item.added", "output_index": index, "item": opened},
        {"type": "response.function_call_arguments.delta", **at, "delta": arguments},
        {"type": "response.function_call_arguments.done", **at, "arguments": arguments},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    input_tokens = int(usage.get("prompt_tokens", 0))
    output_tokens = int(usage.get("output_tokens", 0))
    cached = int(usage.get("cached_prompt_tokens", 0))
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def output_turns(view: ResponseView) -> tuple[ChatTurn, ...]:
    """What the response answered, as the assistant's turn a next response builds on."""
    answer = view.completion.answers[0]
    if answer.tool_calls:
        calls = tuple(EngineToolCall(c.id, c.name, c.arguments) for c in answer.tool_calls)
        return (ChatTurn("assistant", "", calls),)
    return (ChatTurn("assistant", view.released),) if view.message_open else ()
