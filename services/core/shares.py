"""Each tenant's share of a worker, and which runs make room for a tenant under its share.

While several tenants hold runs on a worker (counting a run on its way there), a tenant's
share of the worker's KV blocks is the worker's total in proportion to its weight among
theirs; a tenant alone may hold all of it (work-conserving). An interactive run that
does not fit may have runs of other tenants suspended to make room, if its tenant stays
within its share counting the run: the tenant most over its share (the most blocks per
block of share) gives first, its batch runs before its interactive ones and the youngest
first, and a tenant gives only while it is over its share. Nothing is suspended unless
that frees enough. A run that draws several answers is never suspended.

Preemptions cannot cycle: only a run coming onto a worker suspends others, and a
suspended run goes on only in blocks that no running run holds (the worker's oldest
suspension first), without suspending anyone itself. So every preemption is paid for by
one arriving run, and a tenant under its share never loses a run to one.

Pure: the worker applies `make_room` to its runs; the scheduler, which knows only each
tenant's totals, asks `room_by_share` whether sending a run there could make room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Holding:
    """A run on a worker, as far as shares are concerned."""

    run_id: str
    tenant_id: str
    weight: int
    num_kv_blocks: int
    interactive: bool = True
    since: float = 0.0  # when it came onto the worker: the latest is the youngest
    suspendable: bool = True


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant's runs on a worker: the running ones' blocks, and the suspended."""

    tenant_id: str
    weight: int
    num_kv_blocks: int
    num_runs: int
    num_suspended_runs: int = 0
    # Of `num_kv_blocks`, those of runs that could be suspended (one answer each).
    num_suspendable_blocks: int = 0


def tenant_loads(running: Iterable[Holding], suspended: Iterable[Holding] = ()) -> list[TenantLoad]:
    """Each tenant's load, by tenant id."""
    blocks: Counter[str] = Counter()
    runs: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    suspendable: Counter[str] = Counter()
    weights: dict[str, int] = {}
    for run in running:
        blocks[run.tenant_id] += run.num_kv_blocks
        suspendable[run.tenant_id] += run.num_kv_blocks if run.suspendable else 0
        runs[run.tenant_id] += 1
        weights[run.tenant_id] = run.weight
    for run in suspended:
        waiting[run.tenant_id] += 1
        weights.setdefault(run.tenant_id, run.weight)
    return [
        TenantLoad(t, weights[t], blocks[t], runs[t], waiting[t], suspendable[t])
        for t in sorted(weights)
    ]


def with_runs(loads: Iterable[TenantLoad], runs: Iterable[Holding]) -> list[TenantLoad]:
    """`loads` with `runs` added to their tenants' (runs on their way to the worker)."""
    merged = {load.tenant_id: load for load in loads}
    for more in tenant_loads(runs):
        load = merged.get(more.tenant_id)
        merged[more.tenant_id] = (
            more
            if load is None
            else TenantLoad(
                load.tenant_id,
                load.weight,
                load.num_kv_blocks + more.num_kv_blocks,
                load.num_runs + more.num_runs,
                load.num_suspended_runs,
                load.num_suspendable_blocks + more.num_suspendable_blocks,
            )
        )
    return [merged[t] for t in sorted(merged)]


def shares(weights: dict[str, int], num_total_blocks: int) -> dict[str, float]:
    """Each tenant's share of `num_total_blocks`, by its weight among `weights`."""
    total = sum(max(1, w) for w in weights.values())
    return {t: num_total_blocks * max(1, w) / total for t, w in weights.items()}


def standing(
    loads: Iterable[TenantLoad], others: dict[str, int], num_total_blocks: int
) -> tuple[dict[str, int], dict[str, float]]:
    """What each tenant with runs in `loads` holds, and each one's share among them and
    `others` (tenant -> weight: the run on its way, tenants waiting)."""
    holding = [load for load in loads if load.num_runs]
    held = {load.tenant_id: load.num_kv_blocks for load in holding}
    weights = {load.tenant_id: load.weight for load in holding} | others
    return held, shares(weights, num_total_blocks)


def room_by_share(
    loads: Sequence[TenantLoad],
    tenant_id: str,
    weight: int,
    num_kv_blocks: int,
    num_total_blocks: int,
) -> int:
    """The blocks that runs of tenants over their shares would surely give up for a run of
    `tenant_id` of `num_kv_blocks`: each gives at least what it holds over its share, of
    what its runs that can be suspended hold. 0 where the tenant would be over its share
    with the run, or is alone."""
    held, share = standing(loads, {tenant_id: weight}, num_total_blocks)
    if len(share) < 2 or held.get(tenant_id, 0) + num_kv_blocks > share[tenant_id]:
        return 0
    suspendable = {load.tenant_id: load.num_suspendable_blocks for load in loads}
    return int(
        sum(min(max(0.0, held[t] - share[t]), suspendable[t]) for t in held if t != tenant_id)
    )


def make_room(
    running: Sequence[Holding], run: Holding, num_free_blocks: int, num_total_blocks: int
) -> list[str] | None:
    """The runs to suspend, in order, so that `run` fits in `num_free_blocks` (the blocks
    that no running run holds): None where the rule above suspends nothing for it."""
    if not run.interactive:
        return None
    found, share = standing(tenant_loads(running), {run.tenant_id: run.weight}, num_total_blocks)
    held = dict.fromkeys(share, 0) | found
    if len(share) < 2 or held[run.tenant_id] + run.num_kv_blocks > share[run.tenant_id]:
        return None
    # Each tenant's runs in the order it gives them up: batch first, then the youngest.
    givers = {
        t: sorted(
            (h for h in running if h.tenant_id == t and h.suspendable),
            key=lambda h: (h.interactive, -h.since),
        )
        for t in share
        if t != run.tenant_id
    }
    victims: list[str] = []
    free = num_free_blocks
    while free < run.num_kv_blocks:
        over = [t for t, runs in givers.items() if runs and held[t] > share[t]]
        if not over:
            return None
        tenant = max(over, key=lambda t: held[t] / share[t])
        victim = givers[tenant].pop(0)
        victims.append(victim.run_id)
        held[tenant] -= victim.num_kv_blocks
        free += victim.num_kv_blocks
    return victims


def to_resume(suspended: Sequence[Holding], num_unheld_blocks: int) -> list[str]:
    """Of the runs `suspended` (the longest suspended first), those that go on now: in
    order while the blocks no running run holds take them; the first that does not fit
    holds back the rest, so a large one is not passed over for ever."""
    resumed: list[str] = []
    for run in suspended:
        if run.num_kv_blocks > num_unheld_blocks:
            break
        num_unheld_blocks -= run.num_kv_blocks
        resumed.append(run.run_id)
    return resumed
