"""A run's event stream that survives broken connections: `Stream`, and its asyncio form.

`tollgate.aio_stream` holds `AsyncStream` and is the one source of both:
`make sdk` generates the synchronous `tollgate.stream` from it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from types import TracebackType
from typing import Any

import grpc

from tollgate.convert import event_of, rate_limits_of
from tollgate.errors import StreamGapError, TollgateError, from_rpc_error
from tollgate.resume import Backoff, NextCall, StreamTracker, is_resumable, stream_ended_early
from tollgate.structure import tool_calls_of
from tollgate.transport import AsyncProbe, AsyncSleep
from tollgate.types import RateLimits, RetryPolicy, RunEvent, TokenLogprob, ToolCall, Usage

# Opens one attempt of the stream: Generate or StreamRun, per NextCall.
AsyncOpener = Callable[[NextCall], Any]


class AsyncStream:
    """Iterates a run's events exactly once each, in seq order, reconnecting as needed.

    Tokens come as they are made, in `live` events that repeat the last stored seq;
    the stored event that later holds them comes cut to what was not sent, so each
    token's text comes once. A broken connection is resumed transparently: with
    StreamRun after the last seq and output seen once the run id is known, else with
    Generate again under the same idempotency key. `text`, `logprobs`, `usage`,
    `finish_reason` and `state` accumulate as events go by. Use it as a context manager, or close it, to stop early.
    """

    def __init__(
        self,
        opener: AsyncOpener,
        tracker: StreamTracker,
        policy: RetryPolicy,
        sleep: AsyncSleep = asyncio.sleep,
        probe: AsyncProbe | None = None,
    ) -> None:
        self._open = opener
        self._tracker = tracker
        self._backoff = Backoff(policy)
        self._sleep = sleep
        # Asks the server how the run stands when a stream ends without its last event.
        self._probe = probe
        self._call: Any = None
        self._rate_limits: RateLimits | None = None
        # A threading.Event: the synchronous Stream may be closed from another thread.
        self._closed = threading.Event()
        self._events = self._run()

    @property
    def rate_limits(self) -> RateLimits:
        """The `x-ratelimit-*` metadata the run was admitted with (known from the first
        event on; empty for a stream of a run admitted earlier)."""
        return self._rate_limits or RateLimits()

    @property
    def run_id(self) -> str | None:
        """The run's id, known from the first event on (at once for stream_run)."""
        return self._tracker.run_id

    @property
    def text(self) -> str:
        """The text streamed so far (the first answer's, with n > 1)."""
        return self._tracker.text

    @property
    def texts(self) -> tuple[str, ...]:
        """Every answer's text streamed so far, in index order (one unless n > 1)."""
        return self._tracker.texts

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        """The streamed tokens' log-probabilities so far, when the run asked for them (the
        first answer's, with n > 1)."""
        return self._tracker.logprobs

    @property
    def tool_calls(self) -> tuple[ToolCall, ...] | None:
        """The function calls the run's answer makes, once it has completed; None for a
        text answer, a run offered no tools, or one not (yet) completed."""
        end, run_id = self._tracker.terminal, self._tracker.run_id
        if end is None or end.kind != "completed" or run_id is None:
            return None
        return tool_calls_of(self.text, run_id) if self._tracker.may_call_tools else None

    @property
    def last_seq(self) -> int:
        return self._tracker.last_seq

    @property
    def state(self) -> str | None:
        return self._tracker.state

    @property
    def usage(self) -> Usage | None:
        return self._tracker.usage

    @property
    def finish_reason(self) -> str:
        return self._tracker.finish_reason

    @property
    def terminal_event(self) -> RunEvent | None:
        """The completed, failed or cancelled event, once seen."""
        return self._tracker.terminal

    @property
    def done(self) -> bool:
        return self._tracker.done

    def __aiter__(self) -> AsyncIterator[RunEvent]:
        return self

    async def __anext__(self) -> RunEvent:
        return await self._events.__anext__()

    async def wait(self) -> AsyncStream:
        """Consumes the remaining events; returns this stream."""
        async for _ in self:
            pass
        return self

    def raise_for_outcome(self) -> None:
        """Raises RunFailedError or RunCancelledError when the run ended that way."""
        self._tracker.raise_for_outcome()

    async def aclose(self) -> None:
        """Stops the stream; the run itself goes on (see disconnect_grace)."""
        self._closed.set()
        if self._call is not None:
            self._call.cancel()
        try:
            await self._events.aclose()
        except ValueError:
            # Closed from another thread mid-read: the cancelled call ends that read.
            pass

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _run_has_ended(self) -> bool:
        if self._probe is None or self._tracker.run_id is None:
            return False
        try:
            run = await self._probe(self._tracker.run_id)
        except TollgateError:
            return False  # cannot tell: resume, and let the retry budget decide
        return self._tracker.ended_before(run.state, run.last_seq)

    async def _run(self) -> AsyncGenerator[RunEvent, None]:
        tracker = self._tracker
        while not tracker.done and not self._closed.is_set():
            self._call = call = self._open(tracker.next_call())
            try:
                async for message in call:
                    if self._rate_limits is None:
                        self._rate_limits = rate_limits_of(await call.initial_metadata())
                    event = event_of(message)
                    if not tracker.accept(event):
                        continue
                    self._backoff.progress()
                    yield event
                    if tracker.done:
                        return
                if tracker.done or tracker.ended_cleanly() or await self._run_has_ended():
                    return
                error: TollgateError = stream_ended_early()
            except grpc.RpcError as rpc_error:
                if self._closed.is_set():
                    return
                error = from_rpc_error(rpc_error)
                if not is_resumable(error):
                    raise error from None
            except StreamGapError as gap:
                error = gap
            finally:
                call.cancel()
                self._call = None
            await self._sleep(self._backoff.delay_after(error))
