"""Answers that last: server-sent-event streams, and a whole answer that is given up
when its client hangs up first. The completion routes and the Responses API share them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.admission.http.responses import http_error, sse_frame
from services.core.errors import ApiError

T = TypeVar("T")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


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
