"""Tokens a client sees before they are stored, and where its stream stands (no I/O).

A worker stores a run's `streaming` events at a per-run pace (every so many tokens or
so long, whichever comes first; a run's first tokens and its end at once) and publishes
each step's tokens as they come on LIVE_CHANNEL, to the streams attached to the run.
Every `streaming` payload, stored or live, says where its tokens start among the run's
output: `at` = [tokens, characters of text] before them, over all of the run's answers
in the order the engine made them. The stored events hold the same tokens and text as
the live pieces, in the same order, so a stream that has sent a client the run's output
up to some point cuts what it already sent off the stored events that follow.

A `Position` is such a point: every stored event through `seq`, and the run's output up
to `tokens` (`chars`). A client resumes from one, written `seq` (a stored event's id) or
`seq.tokens.chars` (a live piece's).

Only a run whose first `streaming` event is stored has live pieces: from then on its
worker's loss ends it (`failed`), never runs it again, so what a client saw live is
never replaced by other tokens. What it saw live past the last stored event when its
worker was lost is not in the run's record (at most one store's worth of tokens).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from services.core.runs import RunState, StoredEvent

LIVE_CHANNEL = "tollgate_live"
# PostgreSQL refuses a notice payload of 8000 bytes or more; a bigger piece is not sent
# live (the stored event brings it).
LIVE_NOTICE_MAX_BYTES = 7900
# Live pieces a stream holds while an earlier one is missing; beyond, new ones are let go.
MAX_AHEAD = 256
_POSITION = re.compile(r"([0-9]{1,19})(?:\.([0-9]{1,19})\.([0-9]{1,19}))?")
MAX_SEQ = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Position:
    """Every stored event through `seq`, and the run's output up to `tokens` tokens and
    `chars` characters (0 and 0: nothing beyond what those events hold is known)."""

    seq: int
    tokens: int = 0
    chars: int = 0

    def __str__(self) -> str:
        if not self.tokens and not self.chars:
            return str(self.seq)
        return f"{self.seq}.{self.tokens}.{self.chars}"


def event_id(event: StoredEvent) -> str:
    """Where a client that has `event` stands, as it sends it back to resume: the seq of
    a stored event, the position after a live one, and after a stored one cut to nothing
    (its client had all of it, and maybe more, live)."""
    payload = event.payload
    ahead = event.live or (not payload.get("token_ids") and not payload.get("text"))
    end = end_of(payload) if ahead and event.kind == RunState.STREAMING else None
    return str(Position(event.seq, *end)) if end is not None else str(event.seq)


def parse_position(text: str) -> Position | None:
    """The position a client sent back (`7` or `7.40.183`); None for anything else."""
    match = _POSITION.fullmatch(text.strip())
    if match is None:
        return None
    seq, tokens, chars = (int(g) if g else 0 for g in match.groups())
    if max(seq, tokens, chars) > MAX_SEQ:
        return None
    return Position(seq, tokens, chars)


def offset(payload: Mapping[str, Any]) -> tuple[int, int] | None:
    """Where a `streaming` payload's tokens start (tokens, chars); None when it does not
    say (stored before payloads said it)."""
    at = payload.get("at")
    if not isinstance(at, list | tuple) or len(at) != 2:
        return None
    return int(at[0]), int(at[1])


def end_of(payload: Mapping[str, Any]) -> tuple[int, int] | None:
    """Where a `streaming` payload's tokens end (tokens, chars), None when unknown."""
    start = offset(payload)
    if start is None:
        return None
    return start[0] + len(payload.get("token_ids", ())), start[1] + len(payload.get("text", ""))


def cut(payload: Mapping[str, Any], tokens: int, chars: int) -> dict[str, Any]:
    """`payload` without the run's output before `tokens` (`chars`): what a client that
    has the output up to there still lacks. Empty of tokens when it had all of them."""
    start = offset(payload)
    assert start is not None
    skip_tokens = min(max(tokens - start[0], 0), len(payload.get("token_ids", ())))
    skip_chars = min(max(chars - start[1], 0), len(payload.get("text", "")))
    if not skip_tokens and not skip_chars:
        return dict(payload)
    rest = dict(payload)
    rest["token_ids"] = list(payload.get("token_ids", ()))[skip_tokens:]
    rest["text"] = payload.get("text", "")[skip_chars:]
    rest["at"] = [start[0] + skip_tokens, start[1] + skip_chars]
    if skip_tokens == len(payload.get("token_ids", ())) and skip_chars == len(
        payload.get("text", "")
    ):
        rest["at"] = [max(tokens, rest["at"][0]), max(chars, rest["at"][1])]  # where it stands
    if "logprobs" in payload:
        rest["logprobs"] = list(payload["logprobs"])[skip_tokens:]
    rest.pop("prompt_logprobs", None)  # sent with the run's first tokens
    if not rest["token_ids"]:
        rest.pop("finish_reason", None)  # sent with the answer's last tokens
    return rest


@dataclass(frozen=True, slots=True)
class LivePieces:
    """A run's live pieces, as a worker published them: `streaming` payloads."""

    run_id: str
    tenant_id: str
    pieces: list[dict[str, Any]]


def split_at(event: StoredEvent, after: Position) -> list[tuple[StoredEvent, bool]]:
    """`event` in parts, each with whether a client standing at `after` lacks it. A
    stream replayed from a run's start builds its answer from every part, and sends
    the frames of the parts the client lacks."""
    if not event.live and event.seq <= after.seq:
        return [(event, False)]
    start, end = offset(event.payload), end_of(event.payload)
    upto = (after.tokens, after.chars)
    if event.kind != RunState.STREAMING or start is None or end is None or upto == (0, 0):
        return [(event, True)]
    if end <= upto:
        return [(event, False)]
    if start >= upto:
        return [(event, True)]
    head = dict(event.payload)
    head["token_ids"] = list(event.payload.get("token_ids", ()))[: upto[0] - start[0]]
    head["text"] = event.payload.get("text", "")[: upto[1] - start[1]]
    if "logprobs" in head:
        head["logprobs"] = list(head["logprobs"])[: upto[0] - start[0]]
    head.pop("finish_reason", None)  # the rest ends the answer
    return [
        (dataclasses.replace(event, payload=head), False),
        (dataclasses.replace(event, payload=cut(event.payload, *upto)), True),
    ]


def merged(pieces: Sequence[LivePieces]) -> LivePieces:
    """Several notices' pieces of one run as few pieces as they make: each piece that
    continues the one before (the same answer, which did not end there) joins it. A
    stream that fell behind sends what piled up as one event."""
    out: list[dict[str, Any]] = []
    for piece in (p for notice in pieces for p in notice.pieces):
        last = out[-1] if out else None
        if last is not None and _continues(last, piece):
            out[-1] = _joined(last, piece)
        else:
            out.append(piece)
    return LivePieces(pieces[0].run_id, pieces[0].tenant_id, out)


def _continues(first: Mapping[str, Any], then: Mapping[str, Any]) -> bool:
    return (
        end_of(first) == offset(then) is not None
        and first.get("index", 0) == then.get("index", 0)
        and "finish_reason" not in first
        and "prompt_logprobs" not in then
        and ("logprobs" in first) == ("logprobs" in then)
    )


def _joined(first: Mapping[str, Any], then: Mapping[str, Any]) -> dict[str, Any]:
    joined = {**first, **then, "at": first["at"]}
    joined["token_ids"] = [*first["token_ids"], *then["token_ids"]]
    joined["text"] = first["text"] + then["text"]
    if "logprobs" in first:
        joined["logprobs"] = [*first["logprobs"], *then["logprobs"]]
    if "prompt_logprobs" in first:
        joined["prompt_logprobs"] = first["prompt_logprobs"]
    return joined


def live_notice(run_id: str, tenant_id: str, pieces: Sequence[Mapping[str, Any]]) -> str | None:
    """The notice carrying a run's live pieces; None when it would not fit."""
    body = json.dumps({"tenant_id": tenant_id, "pieces": pieces}, separators=(",", ":"))
    notice = f"{run_id} {body}"
    return notice if len(notice.encode()) <= LIVE_NOTICE_MAX_BYTES else None


def parse_live_notice(notice: str) -> LivePieces:
    run_id, _, body = notice.partition(" ")
    parsed = json.loads(body)
    return LivePieces(run_id, parsed["tenant_id"], parsed["pieces"])


class StreamCursor:
    """Where one stream of a run stands, and what it sends next: each stored event once,
    in seq order, cut of what the stream sent already, and each live piece that
    continues what it sent (one from further on waits for those before it)."""

    def __init__(self, after: Position) -> None:
        self.seq = after.seq
        # The run's output the client has (tokens, chars); None until a stored event says.
        self.upto: tuple[int, int] | None = (
            (after.tokens, after.chars) if after.tokens or after.chars or not after.seq else None
        )
        self._ahead: list[LivePieces] = []

    def stored(self, event: StoredEvent) -> Iterator[StoredEvent]:
        """What to send for the run's next stored event (seq `self.seq + 1`)."""
        self.seq = event.seq
        if event.kind != RunState.STREAMING:
            yield event
            return
        end = end_of(event.payload)
        if end is None:  # stored before payloads said where they start
            self.upto = None
            yield event
            return
        if self.upto is not None:
            event = dataclasses.replace(event, payload=cut(event.payload, *self.upto))
        self.upto = end if self.upto is None else max(self.upto, end)
        yield event
        yield from self._continued()

    def live(self, pieces: LivePieces) -> Iterator[StoredEvent]:
        """What to send of a run's live pieces."""
        for piece in pieces.pieces:
            start, end = offset(piece), end_of(piece)
            if start is None or end is None:
                continue
            if self.upto is None or start > self.upto:
                # Something before it is missing: the run's next stored event brings it.
                if len(self._ahead) < MAX_AHEAD:
                    self._ahead.append(LivePieces(pieces.run_id, pieces.tenant_id, [piece]))
                continue
            if end <= self.upto:
                continue  # sent already
            sent, self.upto = self.upto, end
            yield self._live_event(pieces, cut(piece, *sent))

    def _continued(self) -> Iterator[StoredEvent]:
        """The pieces held back that now continue what was sent."""
        ahead, self._ahead = self._ahead, []
        for pieces in ahead:
            yield from self.live(pieces)

    def _live_event(self, pieces: LivePieces, payload: dict[str, Any]) -> StoredEvent:
        return StoredEvent(
            run_id=pieces.run_id,
            seq=self.seq,
            kind=RunState.STREAMING,
            tenant_id=pieces.tenant_id,
            payload=payload,
            created_at=datetime.now(UTC),
            live=True,
        )
