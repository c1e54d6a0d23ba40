"""What the scheduler tells of each worker it knows: the same dataclass on both sides of
`QueueStats.workers` (the scheduler fills it, admission's console reads it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker as the scheduler last heard from it, with the runs assigned to it."""

    worker_id: str
    model: str  # "" = serves whatever it is sent
    num_free_blocks: int
    num_total_blocks: int  # 0 = not reported yet
    num_running: int
    alive: bool
    draining: bool
    suspect: bool
