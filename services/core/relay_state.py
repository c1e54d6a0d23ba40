"""What the outbox relay keeps track of between passes, without I/O: whether the broker
lost what it acknowledged (`LostLog`), and how often each row was refused (`Refusals`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# Passes that may refuse an event before it is set aside.
MAX_PUBLISH_ATTEMPTS = 3


class LostLog:
    """Tells from the broker's acknowledgements and end offsets that it lost acknowledged
    records (no I/O): offsets on a partition only grow while its log lives, and a
    partition that held a record is never empty again.

    Only emptiness is read from an end offset, not how far it reaches: the broker's end
    may lag its acknowledgements (Tansu's is the start of its last batch, plus one). And
    it is compared with the partitions acknowledged by the check before, so that a record
    acknowledged a moment ago and not yet counted into the end is not taken for a loss.
    """

    def __init__(self, highest: Mapping[int, int] | None = None) -> None:
        self.highest = dict(highest or {})
        self._checked = set(self.highest)

    def acked(self, partition: int, offset: int) -> bool:
        """Records an acknowledgement; True when it is below one recorded before."""
        went_back = offset < self.highest.get(partition, -1)
        self.highest[partition] = max(offset, self.highest.get(partition, -1))
        return went_back

    def ends_lost(self, ends: Mapping[int, int] | None) -> bool:
        """True when the topic is gone, or a partition that held acknowledged records by
        the last check is empty; then counts what is acknowledged now as checked."""
        checked, self._checked = self._checked, set(self.highest)
        if ends is None:
            return bool(checked)
        return any(ends.get(p, 0) == 0 for p in checked)

    def forget(self) -> None:
        self.highest.clear()
        self._checked.clear()


class Refusals:
    """How often each outbox row was refused, until it is set aside (no I/O)."""

    def __init__(self, max_attempts: int = MAX_PUBLISH_ATTEMPTS) -> None:
        self.max_attempts = max_attempts
        self._counts: dict[int, int] = {}

    def refused(self, outbox_id: int) -> bool:
        """Counts one refusal; True once the row is to be set aside (and forgotten here)."""
        count = self._counts[outbox_id] = self._counts.get(outbox_id, 0) + 1
        if count < self.max_attempts:
            return False
        del self._counts[outbox_id]
        return True

    def forget(self, outbox_ids: Iterable[int]) -> None:
        for outbox_id in outbox_ids:
            self._counts.pop(outbox_id, None)
