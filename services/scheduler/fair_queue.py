"""The run queue: two classes, weighted fair queuing across tenants.

Interactive runs come before batch runs.  Within a class each tenant
has its own FIFO, and tenants share dispatches by weighted fair queuing on
virtual finish tags: dispatching a run of cost c (its KV blocks) advances its
tenant's tag by c / weight, and the tenant whose next run would finish first
in virtual time goes next.  So under backlog a tenant of weight 2 gets about
twice the blocks of a tenant of weight 1, and an idle tenant banks no credit
(its tag restarts at the class's virtual time).

Batch runs are kept from starving by aging: once the oldest batch run has waited
`max_batch_wait` seconds it goes ahead of the interactive runs, once; the pick after
it orders the classes strictly again, so aged batch runs take at most every other
dispatch and interactive runs keep the rest.  A promoted run that does not fit is
passed over in its promoted place (it never holds back interactive runs) and keeps
its place in the batch class.

Runs that do not fit any worker right now (`pick`'s `fits`) are skipped, so a
large run does not hold back smaller ones behind it.  Skipping is bounded by
age: once a skipped run has waited `max_skip_age` seconds it becomes a
barrier, nothing behind it in dispatch order is picked, and the capacity
freed by finishing runs goes to it.  A run that can never fit (`may_ever_fit`
false: no live worker serves its model with that many blocks) is skipped
without becoming a barrier; it waits for such a worker to join (`unfit.py` ends it
once live workers serve its model and none could hold it for a while).  Among runs
that fit, each tenant's runs leave in FIFO order; the age of a run is counted
from its creation, so a re-queued run keeps its place.

Pure: no I/O, no clock; callers pass `now`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum


class QueueClass(StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


# Dispatch order of the classes: strict priority.
CLASS_ORDER = (QueueClass.INTERACTIVE, QueueClass.BATCH)


@dataclass(frozen=True, slots=True)
class Ticket:
    """A queued run as far as ordering is concerned."""

    run_id: str
    tenant_id: str
    queue_class: QueueClass
    cost: int  # KV blocks the run needs
    weight: int = 1  # the tenant's weight, > 0
    enqueued_at: float = 0.0  # seconds; orders a tenant's runs and ages skipped ones


Predicate = Callable[[Ticket], bool]


@dataclass(slots=True)
class _ClassQueue:
    # tenant -> its tickets sorted by (enqueued_at, arrival)
    backlog: dict[str, list[tuple[float, int, Ticket]]] = field(default_factory=dict)
    # tenant -> virtual finish tag of its last dispatched run, or the virtual
    # time when it last became backlogged
    finish: dict[str, float] = field(default_factory=dict)
    vtime: float = 0.0
    size: int = 0

    def push(self, ticket: Ticket, arrival: int) -> None:
        if ticket.tenant_id not in self.backlog:
            # Becoming backlogged: no credit for the time it was idle.
            self.finish[ticket.tenant_id] = max(self.finish.get(ticket.tenant_id, 0.0), self.vtime)
        bisect.insort(
            self.backlog.setdefault(ticket.tenant_id, []),
            (ticket.enqueued_at, arrival, ticket),
            key=lambda entry: entry[:2],
        )
        self.size += 1

    def remove(self, ticket: Ticket) -> None:
        entries = self.backlog[ticket.tenant_id]
        entries[:] = [e for e in entries if e[2].run_id != ticket.run_id]
        if not entries:
            del self.backlog[ticket.tenant_id]
        self.size -= 1

    def charge(self, ticket: Ticket) -> None:
        """Accounts a dispatch of `ticket` to its tenant."""
        start = self.finish.get(ticket.tenant_id, self.vtime)
        self.finish[ticket.tenant_id] = start + ticket.cost / ticket.weight
        self.vtime = max(self.vtime, start)
        # A tag at or below vtime says nothing more than vtime does.
        for tenant in [t for t, tag in self.finish.items() if tag <= self.vtime]:
            if tenant not in self.backlog:
                del self.finish[tenant]

    def oldest(self) -> Ticket | None:
        """The ticket that has waited longest: each tenant's first one is its oldest."""
        heads = [entries[0] for entries in self.backlog.values()]
        return min(heads, key=lambda entry: entry[:2])[2] if heads else None

    def order(self) -> Iterator[Ticket]:
        """Every ticket in dispatch order, as if each were dispatched in turn."""
        heads = [
            self._head(tenant, entries, 0, self.finish.get(tenant, self.vtime))
            for tenant, entries in self.backlog.items()
        ]
        heapq.heapify(heads)
        while heads:
            tag, _, _, tenant, index = heapq.heappop(heads)
            entries = self.backlog[tenant]
            yield entries[index][2]
            if index + 1 < len(entries):
                heapq.heappush(heads, self._head(tenant, entries, index + 1, tag))

    def _head(
        self, tenant: str, entries: list[tuple[float, int, Ticket]], index: int, finish: float
    ) -> tuple[float, float, int, str, int]:
        enqueued_at, arrival, ticket = entries[index]
        tag = finish + ticket.cost / ticket.weight
        return (tag, enqueued_at, arrival, tenant, index)


class FairQueue:
    """Queued runs by class and tenant; each run id at most once."""

    def __init__(self, max_skip_age: float = 30.0, max_batch_wait: float = 60.0) -> None:
        self.max_skip_age = max_skip_age
        self.max_batch_wait = max_batch_wait
        self._classes = {queue_class: _ClassQueue() for queue_class in CLASS_ORDER}
        self._tickets: dict[str, Ticket] = {}
        self._arrivals = itertools.count()
        # Whether the last pick was a batch run promoted by aging: the next is not.
        self._promoted_last = False

    def __len__(self) -> int:
        return len(self._tickets)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._tickets

    def count(self, queue_class: QueueClass) -> int:
        return self._classes[queue_class].size

    def push(self, ticket: Ticket) -> bool:
        """Queues `ticket`; False (and no change) when its run is queued already."""
        if ticket.run_id in self._tickets:
            return False
        if ticket.weight <= 0:
            raise ValueError(f"tenant {ticket.tenant_id}: weight must be positive")
        self._tickets[ticket.run_id] = ticket
        self._classes[ticket.queue_class].push(ticket, next(self._arrivals))
        return True

    def remove(self, run_id: str) -> Ticket | None:
        ticket = self._tickets.pop(run_id, None)
        if ticket is not None:
            self._classes[ticket.queue_class].remove(ticket)
        return ticket

    def order(self) -> Iterator[Ticket]:
        """Every queued ticket in strict class order, when all of them fit."""
        for queue_class in CLASS_ORDER:
            yield from self._classes[queue_class].order()

    def promoted(self, now: float) -> Ticket | None:
        """The aged batch ticket that goes ahead of the interactive ones at `now`, if any."""
        if self._promoted_last or not self._classes[QueueClass.INTERACTIVE].size:
            return None
        oldest = self._classes[QueueClass.BATCH].oldest()
        if oldest is None or now - oldest.enqueued_at < self.max_batch_wait:
            return None
        return oldest

    def pick(
        self, fits: Predicate, now: float, may_ever_fit: Predicate = lambda _: True
    ) -> Ticket | None:
        """Removes and returns the next ticket that fits, or None.

        See the module docstring for how non-fitting tickets are skipped.
        """
        promoted = self.promoted(now)
        if promoted is not None and fits(promoted):
            self._promoted_last = True
            return self._take(promoted)
        for ticket in self.order():
            if fits(ticket):
                self._promoted_last = False
                return self._take(ticket)
            if may_ever_fit(ticket) and now - ticket.enqueued_at >= self.max_skip_age:
                return None
        return None

    def _take(self, ticket: Ticket) -> Ticket:
        self.remove(ticket.run_id)
        self._classes[ticket.queue_class].charge(ticket)
        return ticket
