"""StreamTracker and Backoff: the I/O-free half of resuming a stream."""

import random

import grpc
import pytest

from tests.tollgate.fake_gateway import script
from tollgate import convert
from tollgate.errors import (
    QuotaExceededError,
    RunCancelledError,
    RunFailedError,
    StreamGapError,
    TollgateError,
    UnavailableError,
)
from tollgate.resume import Backoff, StreamTracker, is_resumable
from tollgate.types import RetryPolicy, RunEvent


def events(pieces=("a", "b"), end="completed") -> list[RunEvent]:
    return [convert.event_of(e) for e in script("r1", pieces, end=end)]


def generate_tracker(until_terminal: bool = False) -> StreamTracker:
    request = convert.generate_request(
        "hi", messages=None, model="tiny", max_tokens=4, temperature=None, top_k=None,
        top_p=None, seed=None, stop=(), stop_token_ids=(), priority="interactive",
        idempotency_key=None, disconnect_grace=None, until_terminal=until_terminal,
    )  # fmt: skip
    return StreamTracker(request=request, until_terminal=until_terminal)


def test_generate_until_the_first_event_then_stream_run_after_the_last_seq() -> None:
    tracker = generate_tracker()
    first = tracker.next_call()
    assert first.generate is not None and first.generate.idempotency_key
    all_events = events()
    for event in all_events[:3]:
        assert tracker.accept(event)
    call = tracker.next_call()
    assert call.generate is None and call.stream_run is not None
    assert (call.stream_run.run_id, call.stream_run.starting_after) == ("r1", 3)


def test_duplicates_are_dropped_and_state_accumulates() -> None:
    tracker = generate_tracker()
    all_events = events(("Hel", "lo"))
    accepted = [tracker.accept(e) for e in all_events[:4] + all_events[2:]]
    assert accepted == [True] * 4 + [False, False] + [True] * 2
    assert tracker.text == "Hello"
    assert tracker.last_seq == len(all_events)
    assert tracker.finish_reason == "length"
    assert tracker.usage is not None and tracker.usage.output_tokens == 2
    assert tracker.done and tracker.state == "billed"


def test_a_gap_raises() -> None:
    tracker = generate_tracker()
    all_events = events()
    tracker.accept(all_events[0])
    with pytest.raises(StreamGapError) as caught:
        tracker.accept(all_events[2])
    assert (caught.value.expected_seq, caught.value.got_seq) == (2, 3)
    assert tracker.last_seq == 1


def test_an_event_of_another_run_is_refused() -> None:
    tracker = StreamTracker(run_id="other")
    with pytest.raises(TollgateError):
        tracker.accept(events()[0])


def test_until_terminal_is_done_at_the_terminal_event() -> None:
    tracker = generate_tracker(until_terminal=True)
    all_events = events()
    for event in all_events[:-1]:
        tracker.accept(event)
    assert tracker.done and tracker.terminal is not None


def test_a_clean_end_counts_as_the_end_only_after_a_terminal_event() -> None:
    tracker = generate_tracker()
    all_events = events()
    tracker.accept(all_events[0])
    assert not tracker.ended_cleanly()
    for event in all_events[1:-1]:
        tracker.accept(event)
    assert tracker.ended_cleanly()


def test_outcomes() -> None:
    failed = generate_tracker()
    for event in events(end="failed"):
        failed.accept(event)
    with pytest.raises(RunFailedError) as caught:
        failed.raise_for_outcome()
    assert caught.value.code == "WORKER_LOST"
    cancelled = StreamTracker(run_id="r1")
    cancelled.terminal = RunEvent("r1", 3, "cancelled", "cancelled", cancel_reason="client")
    with pytest.raises(RunCancelledError):
        cancelled.raise_for_outcome()


def piece(seq: int, text: str, at: tuple[int, int], live: bool = False) -> RunEvent:
    """A streaming event of one token per two characters of `text`."""
    tokens = tuple(range(len(text) // 2 or 1)) if text else ()
    return RunEvent(
        "r1", seq, "streaming", "streaming", text=text, token_ids=tokens, at=at, live=live
    )


def marker(seq: int, kind: str) -> RunEvent:
    return RunEvent("r1", seq, kind, kind)


def live_stream() -> list[RunEvent]:
    """A run whose tokens came live, then stored, and each stored event cut to what the
    stream had not sent: all of it for seq 4, the last two characters' token for seq 5."""
    return [
        marker(1, "queued"),
        marker(2, "prefill"),
        piece(3, "Hel", (0, 0)),
        piece(3, "lo", (1, 3), live=True),
        piece(3, ", ", (2, 5), live=True),
        piece(4, "", (3, 7)),
        piece(4, "wor", (3, 7), live=True),
        piece(5, "ld", (4, 10)),
        marker(6, "completed"),
        marker(7, "billed"),
    ]


def test_live_and_stored_events_give_each_tokens_text_once() -> None:
    tracker = generate_tracker()
    assert [tracker.accept(e) for e in live_stream()] == [True] * 10
    assert tracker.text == "Hello, world"
    assert (tracker.last_seq, tracker.output) == (7, (5, 12))
    assert tracker.done


def test_a_replayed_live_event_and_a_stored_event_cut_to_nothing_count_nothing_twice() -> None:
    tracker = generate_tracker()
    stream = live_stream()
    for event in stream[:5]:
        tracker.accept(event)
    assert not tracker.accept(stream[3])  # "lo" again
    assert not tracker.accept(piece(3, "Hel", (0, 0)))  # as stored, then seen live
    assert tracker.accept(stream[5])  # seq 4, cut to nothing: seen, holds no text
    assert not tracker.accept(stream[5])
    assert not tracker.accept(stream[4])  # ", " live, from before seq 4
    assert (tracker.text, tracker.last_seq, tracker.output) == ("Hello, ", 4, (3, 7))


def test_a_resume_after_live_events_asks_for_the_output_beyond_the_last_stored_seq() -> None:
    tracker = generate_tracker()
    for event in live_stream()[:7]:
        tracker.accept(event)
    call = tracker.next_call().stream_run
    assert call is not None and call.live
    position = (call.starting_after, call.after_tokens, call.after_chars)
    assert position == (4, 4, 10)


def test_generate_asks_for_live_events() -> None:
    call = generate_tracker().next_call().generate
    assert call is not None and call.live


@pytest.mark.parametrize(
    "event",
    [
        piece(3, "wor", (3, 7), live=True),  # after ", ", which did not come
        piece(3, "lo", (1, 4), live=True),  # the right token, the wrong character
        piece(4, "lo", (1, 3), live=True),  # after a stored seq that did not come
        piece(4, "lo, ", (0, 0)),  # stored, starting before what was seen
        piece(4, "", (2, 6)),  # cut to nothing, beyond what was seen
    ],
    ids=[
        "live-beyond",
        "live-misplaced",
        "live-after-a-missing-seq",
        "stored-overlap",
        "stored-beyond",
    ],
)
def test_output_that_does_not_continue_what_was_seen_is_a_gap(event: RunEvent) -> None:
    tracker = generate_tracker()
    for seen in live_stream()[:3]:
        tracker.accept(seen)
    with pytest.raises(StreamGapError) as caught:
        tracker.accept(event)
    assert caught.value.run_id == "r1" and is_resumable(caught.value)
    assert (tracker.text, tracker.output) == ("Hel", (1, 3))


def test_events_that_do_not_say_where_their_tokens_start_resume_by_seq_alone() -> None:
    tracker = generate_tracker()
    for event in events(("Hel", "lo"))[:4]:
        assert tracker.accept(event)
    assert (tracker.text, tracker.output) == ("Hello", None)
    call = tracker.next_call().stream_run
    assert call is not None
    assert (call.starting_after, call.after_tokens, call.after_chars) == (4, 0, 0)


def test_a_stream_started_after_a_seq_takes_its_position_from_the_first_piece() -> None:
    tracker = StreamTracker(run_id="r1", starting_after=4)
    assert tracker.output is None
    assert tracker.accept(piece(4, "wor", (3, 7), live=True))
    assert tracker.accept(piece(5, "ld", (4, 10)))
    assert (tracker.text, tracker.output) == ("world", (5, 12))


def unavailable(retry_after: float | None = None) -> UnavailableError:
    error = UnavailableError("UNAVAILABLE", "x", [], grpc.StatusCode.UNAVAILABLE)
    if retry_after is not None:
        from google.rpc import error_details_pb2

        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromNanoseconds(int(retry_after * 1e9))
        error.details.append(info)
    return error


def test_backoff_grows_is_capped_and_resets_on_progress() -> None:
    policy = RetryPolicy(max_attempts=10, initial_backoff=1.0, max_backoff=4.0, multiplier=2.0)
    backoff = Backoff(policy, random.Random(0))
    delays = [backoff.delay_after(unavailable()) for _ in range(5)]
    for delay, cap in zip(delays, [1, 2, 4, 4, 4], strict=True):
        assert cap / 2 <= delay <= cap
    backoff.progress()
    assert backoff.delay_after(unavailable()) <= 1.0


def test_backoff_gives_up_after_max_attempts() -> None:
    backoff = Backoff(RetryPolicy(max_attempts=3, initial_backoff=0.01))
    error = unavailable()
    backoff.delay_after(error)
    backoff.delay_after(error)
    with pytest.raises(UnavailableError):
        backoff.delay_after(error)


def test_backoff_honours_retry_info_within_bounds() -> None:
    backoff = Backoff(RetryPolicy(initial_backoff=0.01, max_retry_after=5))
    assert backoff.delay_after(unavailable(retry_after=2.0)) == pytest.approx(2.0)
    with pytest.raises(UnavailableError):
        backoff.delay_after(unavailable(retry_after=60))


def test_which_errors_resume() -> None:
    def error(code: grpc.StatusCode, message: str = "x") -> TollgateError:
        return TollgateError(code.name, message, [], code)

    assert is_resumable(error(grpc.StatusCode.UNAVAILABLE))
    assert is_resumable(error(grpc.StatusCode.CANCELLED))
    assert is_resumable(error(grpc.StatusCode.DEADLINE_EXCEEDED))
    assert is_resumable(error(grpc.StatusCode.INTERNAL, "Received RST_STREAM with code 2"))
    assert is_resumable(StreamGapError("r", 2, 3))
    assert not is_resumable(error(grpc.StatusCode.INTERNAL))
    assert not is_resumable(error(grpc.StatusCode.NOT_FOUND))
    assert not is_resumable(QuotaExceededError("RESOURCE_EXHAUSTED", "x", [], None))
