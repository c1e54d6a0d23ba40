"""Bookkeeping of one run's event stream across reconnects, free of I/O.

`StreamTracker` accepts each event once, in `seq` order, accumulates the text and
outcome, and says which call continues the stream: Generate again with the same
request (same idempotency key, so it attaches to the same run) while no event has
arrived, else StreamRun after the last seq seen. `Backoff` decides how long to
wait before the next attempt, and when to give up.

Live events (tokens not stored yet) repeat the last stored event's seq; the tracker
places them by where their tokens start in the run's output (`RunEvent.at`), and
resumes from the last stored seq plus the output it has beyond it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import grpc

from tollgate.errors import (
    RunCancelledError,
    RunFailedError,
    StreamGapError,
    TollgateError,
    UnavailableError,
)
from tollgate.types import RetryPolicy, RunEvent, TokenLogprob, Usage
from tollgate.v1 import events_pb2, gateway_pb2

# A stream that ends with one of these is continued rather than reported.
RESUMABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


def is_resumable(error: TollgateError) -> bool:
    """True when a broken stream should be reconnected rather than reported."""
    if isinstance(error, StreamGapError):
        return True
    if error.status_code in RESUMABLE_CODES:
        return True
    # A connection reset mid-stream surfaces as INTERNAL with the HTTP/2 reset in the text.
    return error.status_code == grpc.StatusCode.INTERNAL and "RST_STREAM" in error.message


TERMINAL_STATE_NAMES = frozenset({"completed", "failed", "cancelled"})


def stream_ended_early() -> UnavailableError:
    return UnavailableError(
        "UNAVAILABLE", "the stream ended before the run did", [], grpc.StatusCode.UNAVAILABLE
    )


@dataclass(frozen=True, slots=True)
class NextCall:
    """The call that (re)opens the stream: exactly one of the two requests is set."""

    generate: events_pb2.GenerateRequest | None = None
    stream_run: gateway_pb2.StreamRunRequest | None = None


def parse_position(position: int | str) -> tuple[int, tuple[int, int] | None]:
    """A seq, or an event's `position` (`seq.tokens.chars`): the seq and the output."""
    if isinstance(position, int):
        return position, None
    parts = position.strip().split(".")
    if len(parts) not in (1, 3) or not all(p.isascii() and p.isdigit() for p in parts):
        raise ValueError(f"not a seq or an event's position: {position!r}")
    if len(parts) == 1:
        return int(parts[0]), None
    return int(parts[0]), (int(parts[1]), int(parts[2]))


class StreamTracker:
    """Dedupes and orders one run's events and accumulates what they say."""

    def __init__(
        self,
        *,
        request: events_pb2.GenerateRequest | None = None,
        run_id: str | None = None,
        starting_after: int | str = 0,
        until_terminal: bool = False,
    ) -> None:
        if (request is None) == (run_id is None):
            raise ValueError("give either a Generate request or a run id")
        self.request = request
        self.run_id = run_id
        self.last_seq, output = parse_position(starting_after)
        # Where the stream stands in the run's output (tokens, characters of text): the
        # end of the last streaming payload accepted. None while unknown: a stream
        # started after some seq, or a server whose payloads do not say where they start.
        self.output: tuple[int, int] | None = output or ((0, 0) if self.last_seq == 0 else None)
        self.until_terminal = until_terminal
        self.state: str | None = None
        self.usage: Usage | None = None
        self.finish_reason = ""
        self.terminal: RunEvent | None = None
        self.last_event: RunEvent | None = None
        self._done = False
        # Each answer's text (index 0 alone unless the run asked for n > 1).
        self._texts: dict[int, list[str]] = {}
        self._logprobs: list[TokenLogprob] = []

    @property
    def text(self) -> str:
        """The first answer's text."""
        return "".join(self._texts.get(0, []))

    @property
    def texts(self) -> tuple[str, ...]:
        """Every answer's text, in index order (n > 1)."""
        return tuple("".join(self._texts[i]) for i in sorted(self._texts))

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        return tuple(self._logprobs)

    @property
    def may_call_tools(self) -> bool:
        """Whether the run was offered tools to call (True when the request is not known)."""
        if self.request is None:
            return True
        sampling = self.request.sampling
        return bool(sampling.tools) and sampling.tool_choice.mode != "none"

    @property
    def done(self) -> bool:
        return self._done

    def accept(self, event: RunEvent) -> bool:
        """Records `event`; False for a duplicate. Raises StreamGapError on a gap: a
        stored event after the next seq, or output that does not continue what was seen."""
        if self.run_id is None:
            self.run_id = event.run_id
        elif event.run_id != self.run_id:
            raise TollgateError(
                "DATA_LOSS", f"event of run {event.run_id} on the stream of {self.run_id}"
            )
        is_new = self._is_new_live(event) if event.live else self._is_new_stored(event)
        if is_new:
            self._record(event)
        return is_new

    def _is_new_stored(self, event: RunEvent) -> bool:
        if event.seq <= self.last_seq:
            return False
        if event.seq != self.last_seq + 1:
            raise self._gap(event, self.last_seq + 1)
        if event.at is None or self.output is None or event.at == self.output:
            return True
        # Cut to nothing: the stream had sent all of its tokens live.
        if _is_empty(event) and _at_or_before(event.at, self.output):
            return True
        raise self._gap(event, self.last_seq, self.output or (0, 0))

    def _is_new_live(self, event: RunEvent) -> bool:
        if event.seq > self.last_seq:
            raise self._gap(event, self.last_seq + 1)
        if event.at is None:
            raise self._gap(event, self.last_seq, self.output or (0, 0))
        if self.output is not None and _at_or_before(_end_of(event, event.at), self.output):
            return False
        if event.seq == self.last_seq and self.output in (None, event.at):
            return True
        raise self._gap(event, self.last_seq, self.output or (0, 0))

    def _gap(
        self, event: RunEvent, expected_seq: int, expected_at: tuple[int, int] | None = None
    ) -> StreamGapError:
        assert self.run_id is not None  # accept sets it first
        return StreamGapError(self.run_id, expected_seq, event.seq, expected_at, event.at)

    def _record(self, event: RunEvent) -> None:
        self._advance_output(event)
        self.last_seq = event.seq
        self.last_event = event
        self.state = event.state
        if event.text:
            self._texts.setdefault(event.index, []).append(event.text)
        if event.index == 0:
            self._logprobs.extend(event.logprobs)
        if event.usage is not None:
            self.usage = event.usage
        if event.finish_reason and event.kind != "streaming":  # not one answer's end
            self.finish_reason = event.finish_reason
        if event.is_terminal:
            self.terminal = event
        if event.is_final or (event.is_terminal and self.until_terminal):
            self._done = True

    def _advance_output(self, event: RunEvent) -> None:
        if event.kind != "streaming":
            return
        if event.at is None:
            self.output = None
        elif self.output is None or event.at == self.output:
            self.output = _end_of(event, event.at)

    def ended_cleanly(self) -> bool:
        """The server closed the stream with OK: done if the run has ended, else resume."""
        if self.terminal is not None or self._done:
            self._done = True
        return self._done

    def ended_before(self, state: str, last_seq: int) -> bool:
        """Whether the run, as the server reports it, has nothing after what was seen."""
        finished = state == "billed" or (self.until_terminal and state in TERMINAL_STATE_NAMES)
        if finished and last_seq <= self.last_seq:
            self._done = True
        return self._done

    def next_call(self) -> NextCall:
        if self.run_id is None:
            return NextCall(generate=self.request)
        tokens, chars = self.output or (0, 0)
        return NextCall(
            stream_run=gateway_pb2.StreamRunRequest(
                run_id=self.run_id,
                starting_after=self.last_seq,
                after_tokens=tokens,
                after_chars=chars,
                until_terminal=self.until_terminal,
                live=True,
            )
        )

    def raise_for_outcome(self) -> None:
        """Raises RunFailedError / RunCancelledError when the run ended that way."""
        end = self.terminal
        if end is None or end.kind == "completed":
            return
        if end.kind == "failed":
            raise RunFailedError(end.run_id, end.error_code, end.error_message or end.error_code)
        raise RunCancelledError(end.run_id, end.cancel_reason)


def _end_of(event: RunEvent, at: tuple[int, int]) -> tuple[int, int]:
    return at[0] + len(event.token_ids), at[1] + len(event.text)


def _at_or_before(point: tuple[int, int], other: tuple[int, int]) -> bool:
    return point[0] <= other[0] and point[1] <= other[1]


def _is_empty(event: RunEvent) -> bool:
    return not event.token_ids and not event.text


class Backoff:
    """Counts failed attempts in a row; any new event resets the count."""

    def __init__(self, policy: RetryPolicy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.failures = 0
        self._rng = rng or random.Random()

    def progress(self) -> None:
        self.failures = 0

    def delay_after(self, error: TollgateError) -> float:
        """Seconds to wait before the next attempt; raises `error` when out of attempts."""
        self.failures += 1
        if self.failures >= self.policy.max_attempts:
            raise error
        retry_after = getattr(error, "retry_after", None)
        if retry_after is not None and retry_after > self.policy.max_retry_after:
            raise error
        exponential = self.policy.initial_backoff * self.policy.multiplier ** (self.failures - 1)
        capped = min(self.policy.max_backoff, exponential)
        # Equal jitter: clients cut off together do not reconnect together.
        delay = capped / 2 + self._rng.uniform(0, capped / 2)
        return max(delay, retry_after or 0.0)
