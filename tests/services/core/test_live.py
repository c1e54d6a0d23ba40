"""Positions in a run's output, and what a stream sends of stored events and live pieces."""

from datetime import UTC, datetime
from typing import Any

import pytest

from services.core.live import (
    LivePieces,
    Position,
    StreamCursor,
    cut,
    event_id,
    live_notice,
    merged,
    parse_live_notice,
    parse_position,
    split_at,
)
from services.core.runs import RunState, StoredEvent

NOW = datetime(2026, 12, 7, tzinfo=UTC)


def piece(first: int, count: int, chars: int | None = None, **extra: Any) -> dict[str, Any]:
    """`count` tokens from token `first`, each one character (or the text given)."""
    text = extra.pop("text", "".join(chr(ord("a") + (t % 26)) for t in range(first, first + count)))
    return {"token_ids": list(range(first, first + count)), "text": text,
            "at": [first, first if chars is None else chars], **extra}  # fmt: skip


def stored(
    seq: int, payload: dict[str, Any] | None = None, kind: RunState = RunState.STREAMING
) -> StoredEvent:
    return StoredEvent("r", seq, kind, "t", payload or {}, NOW)


def live(*pieces: dict[str, Any]) -> LivePieces:
    return LivePieces("r", "t", list(pieces))


def tokens(events: list[StoredEvent]) -> list[int]:
    return [t for e in events for t in e.payload.get("token_ids", [])]


@pytest.mark.parametrize(
    ("text", "position"),
    [("7", Position(7)), ("7.40.183", Position(7, 40, 183)), (" 0 ", Position(0))],
)
def test_a_position_reads_back_as_it_was_written(text: str, position: Position) -> None:
    assert parse_position(text) == position
    assert parse_position(str(position)) == position


@pytest.mark.parametrize(
    "text", ["", "-1", "7.40", "7.4.0.1", "x", "²", "1.2.99999999999999999999"]
)
def test_anything_else_is_not_a_position(text: str) -> None:
    assert parse_position(text) is None


def test_a_live_event_s_id_is_the_position_after_it_a_stored_one_s_its_seq() -> None:
    event = stored(4, piece(10, 3, chars=20, text="héé"))
    assert event_id(event) == "4"
    assert (
        event_id(StoredEvent("r", 4, RunState.STREAMING, "t", event.payload, NOW, live=True))
        == "4.13.23"
    )


def test_cut_leaves_what_a_client_lacks_with_its_logprobs() -> None:
    payload = piece(5, 4, logprobs=[{"token_id": t} for t in range(5, 9)], finish_reason="stop")
    rest = cut(payload, 7, 7)
    assert rest["token_ids"] == [7, 8] and rest["text"] == "hi" and rest["at"] == [7, 7]
    assert [e["token_id"] for e in rest["logprobs"]] == [7, 8]
    assert rest["finish_reason"] == "stop"
    nothing = cut(payload, 9, 9)
    assert nothing["token_ids"] == [] and nothing["text"] == "" and "finish_reason" not in nothing
    assert cut(payload, 2, 2) == payload


def test_a_stream_sends_live_pieces_and_cuts_them_off_the_stored_event() -> None:
    cursor = StreamCursor(Position(0))
    sent = [*cursor.stored(stored(3, piece(0, 1)))]
    sent += [*cursor.live(live(piece(1, 1))), *cursor.live(live(piece(2, 2)))]
    sent += [*cursor.live(live(piece(1, 1)))]  # a duplicate
    sent += [*cursor.stored(stored(4, piece(1, 5)))]  # tokens 1-5: 1-3 went live
    assert tokens(sent) == [0, 1, 2, 3, 4, 5]
    assert [(e.seq, e.live) for e in sent] == [(3, False), (3, True), (3, True), (4, False)]


def test_a_piece_from_further_on_waits_for_the_stored_event_before_it() -> None:
    cursor = StreamCursor(Position(0))
    assert [*cursor.live(live(piece(3, 1)))] == []  # tokens 0-2 are not here yet
    sent = [*cursor.stored(stored(3, piece(0, 3))), *cursor.live(live(piece(4, 1)))]
    assert tokens(sent) == [0, 1, 2, 3, 4]


def test_a_stream_resumed_from_a_seq_places_live_pieces_once_a_stored_event_says_where() -> None:
    cursor = StreamCursor(Position(5))
    assert [*cursor.live(live(piece(8, 1)))] == []
    sent = [*cursor.stored(stored(6, piece(6, 2))), *cursor.live(live(piece(9, 1)))]
    assert tokens(sent) == [6, 7, 8, 9]


def test_stored_events_that_do_not_say_where_they_start_go_as_they_are() -> None:
    cursor = StreamCursor(Position(0))
    old = stored(3, {"token_ids": [1, 2], "text": "ab"})
    assert [*cursor.stored(old)] == [old]
    assert [*cursor.live(live(piece(2, 1)))] == []  # cannot be placed: left to the store
    assert [*cursor.stored(stored(4, {"kind": "x"}, RunState.COMPLETED))] == [
        stored(4, {"kind": "x"}, RunState.COMPLETED)
    ]


def test_a_replayed_stream_splits_the_event_a_client_has_part_of() -> None:
    after = Position(3, 7, 7)
    assert split_at(stored(3, piece(0, 3)), after) == [(stored(3, piece(0, 3)), False)]
    [(head, had), (rest, lacks)] = split_at(stored(4, piece(3, 6)), after)
    assert (head.payload["token_ids"], had) == ([3, 4, 5, 6], False)
    assert (rest.payload["token_ids"], lacks) == ([7, 8], True)
    assert split_at(stored(5, {}, RunState.COMPLETED), after)[0][1] is True
    assert split_at(stored(4, piece(3, 6)), Position(3))[0][1] is True


def test_a_notice_carries_pieces_up_to_the_limit() -> None:
    notice = live_notice("r", "t", [piece(0, 2)])
    assert notice is not None and parse_live_notice(notice) == live(piece(0, 2))
    assert live_notice("r", "t", [piece(0, 1, text="x" * 8000)]) is None


def test_pieces_that_piled_up_go_as_one_until_an_answer_ends() -> None:
    notices = [live(piece(0, 1)), live(piece(1, 2)), live(piece(3, 1, finish_reason="stop"))]
    notices.append(live(piece(4, 1, index=1)))
    [whole, other] = merged(notices).pieces
    assert whole == piece(0, 4, finish_reason="stop")
    assert other == piece(4, 1, index=1)
    # A gap is not joined over.
    assert len(merged([live(piece(0, 1)), live(piece(2, 1))]).pieces) == 2


def test_a_stored_event_a_client_had_all_of_and_more_says_where_the_client_stands() -> None:
    cursor = StreamCursor(Position(0))
    [
        *cursor.stored(stored(3, piece(0, 1))),
        *cursor.live(live(piece(1, 2))),
        *cursor.live(live(piece(3, 2))),
    ]
    [event] = cursor.stored(stored(4, piece(1, 2)))  # tokens 1-2: the client has up to 5
    assert event.payload["token_ids"] == [] and event_id(event) == "4.5.5"
    # Resumed from there: nothing the client had comes again.
    resumed = StreamCursor(parse_position(event_id(event)) or Position(0))
    assert tokens([*resumed.stored(stored(5, piece(3, 4)))]) == [5, 6]
