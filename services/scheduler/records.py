"""The scheduler's values: queued runs, assignments, projection rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.sampling import blocks_for_run
from services.core.runs import RunState, is_ended
from services.core.shares import Holding
from services.scheduler.fair_queue import QueueClass, Ticket

# Lease owner while the scheduler itself settles a run whose worker was lost.
SCHEDULER_OWNER = "scheduler"


@dataclass(frozen=True, slots=True)
class QueuedRun:
    """A run in state `queued`, with what dispatch needs from its latest `queued` event."""

    run_id: str
    tenant_id: str
    model: str
    queue_class: QueueClass
    last_seq: int
    payload: Mapping[str, Any]  # the latest `queued` event's payload
    traceparent: str
    created_at: float  # epoch seconds of the run's creation
    queued_at: float  # epoch seconds of its latest `queued` event
    weight: int
    num_kv_blocks: int
    # The lease epoch it was read at: a lease is taken only from that epoch, so of two
    # dispatchers that read the same run, one leases it.
    lease_epoch: int = 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return [int(token) for token in self.payload.get("prompt_token_ids", [])]

    @property
    def sampling(self) -> Mapping[str, Any]:
        return self.payload.get("sampling", {})

    def holding(self, since: float) -> Holding:
        """The run on a worker, as far as shares are concerned, from `since`."""
        return Holding(
            self.run_id,
            self.tenant_id,
            self.weight,
            self.num_kv_blocks,
            interactive=self.queue_class == QueueClass.INTERACTIVE,
            since=since,
            suspendable=int(self.sampling.get("n", 1)) == 1,
        )

    def ticket(self) -> Ticket:
        return Ticket(
            run_id=self.run_id,
            tenant_id=self.tenant_id,
            queue_class=self.queue_class,
            cost=self.num_kv_blocks,
            weight=max(1, self.weight),
            enqueued_at=self.created_at,
        )


def queued_run(
    *,
    run_id: str,
    tenant_id: str,
    model: str,
    priority: str,
    last_seq: int,
    payload: Mapping[str, Any],
    traceparent: str,
    created_at: float,
    queued_at: float,
    weight: int,
    block_size: int,
    lease_epoch: int = 0,
) -> QueuedRun:
    """A QueuedRun from the projection's columns and its latest `queued` event."""
    return QueuedRun(
        run_id=run_id,
        tenant_id=tenant_id,
        model=model,
        queue_class=queue_class_of(priority),
        last_seq=last_seq,
        payload=payload,
        traceparent=traceparent,
        created_at=created_at,
        queued_at=queued_at,
        weight=weight,
        num_kv_blocks=num_kv_blocks_of(payload, block_size),
        lease_epoch=lease_epoch,
    )


def num_kv_blocks_of(payload: Mapping[str, Any], block_size: int) -> int:
    """The blocks admission reserved, or what the prompt and its answers need."""
    reserved = int(payload.get("num_kv_blocks", 0) or 0)
    if reserved > 0:
        return reserved
    sampling = payload.get("sampling", {})
    num_prompt = len(payload.get("prompt_token_ids", []))
    max_tokens = int(sampling.get("max_tokens", 0) or 0)
    return max(1, blocks_for_run(num_prompt, max_tokens, int(sampling.get("n", 1)), block_size))


def queue_class_of(priority: str) -> QueueClass:
    return QueueClass.BATCH if priority == QueueClass.BATCH else QueueClass.INTERACTIVE


@dataclass(frozen=True, slots=True)
class Assignment:
    """A run handed to a worker under a lease epoch, until it ends."""

    run_id: str
    tenant_id: str
    worker_id: str
    lease_epoch: int
    since: float  # monotonic seconds
    # The run's last seq when leased: a run `queued` at a later seq was handed back.
    last_seq: int


@dataclass(frozen=True, slots=True)
class RunStatus:
    """The projection columns the scheduler watches."""

    run_id: str
    tenant_id: str
    state: RunState
    owner: str | None
    lease_epoch: int
    last_seq: int

    @property
    def has_ended(self) -> bool:
        return is_ended(self.state)
