"""Answers that last: server-sent-event streams and where one resumes, and a whole answer
folded from a run's events, given up when its client hangs up first. The completion
routes, the Responses API and the Messages API share them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.admission.http.anthropic_answers import shaped_for
from services.admission.http.responses import HttpError, http_error, run_failure, sse_frame
from services.core.errors import ApiError, FieldViolation, InvalidArgument
from services.core.live import Position, parse_position, split_at
from services.core.runs import RunState, StoredEvent, is_terminal

T = TypeVar("T")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class Folds(Protocol):
    """An answer built from a run's events as they come."""

    def add(self, event: StoredEvent) -> None: ...


def resume_point(last_event_id: str | None, starting_after: int) -> Position:
    """Where a stream goes on after: `Last-Event-ID` (an event's id: a seq, or a live
    event's position), else `starting_after`."""
    if last_event_id is None:
        return Position(starting_after)
    position = parse_position(last_event_id)
    if position is None:
        raise InvalidArgument(
            [FieldViolation("Last-Event-ID", "must be an event's id: a seq, or seq.tokens.chars")]
        )
    return position


async def resumed_frames(
    events: AsyncIterator[StoredEvent],
    after: Position,
    frames: Callable[[StoredEvent], list[bytes]],
) -> AsyncIterator[bytes]:
    """The frames of a stream replayed from a run's start (its answer is built from
    every event) that a client standing at `after` lacks."""
    async for event in events:
        for part, lacks in split_at(event, after):
            made = frames(part)
            if lacks:
                for frame in made:
                    yield frame


async def until_terminal(events: AsyncIterator[StoredEvent], answer: Folds) -> StoredEvent:
    """Feeds the run's events into `answer` until the terminal one, which it returns."""
    async for event in events:
        answer.add(event)
        if is_terminal(event.kind):
            return event
    raise AssertionError("a run's events end with a terminal one")


def whole_answer(
    path: str,
    ended: StoredEvent | None,
    body: Callable[[], dict[str, Any]],
    headers: dict[str, str],
) -> JSONResponse:
    """The whole answer of a run that ended with `ended` (None: its client left), or the
    error it failed or was cancelled with, in the shape of `path`'s API."""
    failure = run_failure(ended) if ended is not None else None
    if failure is None:
        return JSONResponse(body(), headers=headers)
    status = 409 if ended is not None and ended.kind == RunState.CANCELLED else 500
    answer = shaped_for(path, HttpError(status, failure, headers))
    return JSONResponse(answer.body, answer.status, headers=answer.headers)


def openai_error_frame(error: ApiError) -> bytes:
    return sse_frame(http_error(error).body)


def sse_response(
    frames: AsyncIterator[bytes],
    run_id: str,
    extra: Mapping[str, str] | None = None,
    error_frame: Callable[[ApiError], bytes] = openai_error_frame,
) -> StreamingResponse:
    """`frames` as an SSE answer; `error_frame` writes an error that ends the stream in
    the API's own shape."""
    headers = {"x-request-id": run_id, **SSE_HEADERS, **(extra or {})}
    return StreamingResponse(
        _until_refused(frames, error_frame), media_type="text/event-stream", headers=headers
    )


async def _until_refused(
    frames: AsyncIterator[bytes], error_frame: Callable[[ApiError], bytes]
) -> AsyncIterator[bytes]:
    """The frames, and an API error raised while they stream (the key was revoked) as a
    last `error` frame: the answer's status went out with the first frame."""
    try:
        async for frame in frames:
            yield frame
    except ApiError as error:
        yield error_frame(error)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None once the client hangs up first (then `work` is cancelled,
    which detaches from the run as a broken stream does)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()
        # Waited for, so the run is detached before the answer goes.
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
