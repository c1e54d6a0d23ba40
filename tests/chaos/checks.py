"""The chaos's verdict, from outside: the invariants in the database (reconcile.check),
every token delivered exactly once to the client that resumed, every event on the topic,
every worker pool free, and how quickly a lost worker's runs were settled."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from services.core.db import open_db
from services.ledger.reconcile import InvariantReport, Scope, check
from tests.chaos.evidence import busy_workers, published, settled_after, stored_events
from tests.chaos.faults import WorkerKill
from tests.chaos.load import RunRecord

UNBILLED_GRACE_S = 5.0


@dataclass
class Verdict:
    violations: dict[str, list[str]] = field(default_factory=dict)
    stuck_run_ids: list[str] = field(default_factory=list)
    settle_seconds: list[float] = field(default_factory=list)

    def add(self, name: str, items: list[str]) -> None:
        if items:
            self.violations.setdefault(name, []).extend(items)

    @property
    def num_violations(self) -> int:
        return sum(len(items) for items in self.violations.values())


def invariants(database_url: str) -> InvariantReport:
    """Every invariant over every run; any run not ended by now counts as stuck."""

    async def run() -> InvariantReport:
        db = open_db(database_url, pool_size=2)
        try:
            return await check(db, Scope(), unbilled_grace=UNBILLED_GRACE_S, stuck_after=0.0)
        finally:
            await db.dispose()

    return asyncio.run(run())


def delivery_problems(
    records: list[RunRecord], stored: dict[str, list[tuple[int, str, list[int]]]]
) -> list[str]:
    """Runs whose client did not receive each stored event, and each token, exactly once.
    A run whose worker was lost, or that was cancelled while its worker's last tokens were
    on their way, may have sent its client tokens live that were never stored: they come
    after every stored one."""
    problems = []
    for record in records:
        if record.run_id is None:
            problems.append(f"{record.idempotency_key}: never admitted ({record.error})")
            continue
        received = [event.seq for event in record.events if not event.live]
        events = stored.get(record.run_id, [])
        if received != [seq for seq, _, _ in events]:
            problems.append(
                f"{record.run_id}: received seqs {_short(received)}, stored {len(events)}"
            )
        tokens = [
            t for event in record.events if event.kind == "streaming" for t in event.token_ids
        ]
        stored_tokens = [t for _, kind, ids in events if kind == "streaming" for t in ids]
        # Ended where its worker's last tokens were not stored: lost, or cancelled meanwhile.
        cut_short = any(kind in ("failed", "cancelled") for _, kind, _ in events)
        is_prefix = tokens[: len(stored_tokens)] == stored_tokens
        if tokens != stored_tokens and not (cut_short and is_prefix):
            problems.append(
                f"{record.run_id}: received {len(tokens)} tokens, stored {len(stored_tokens)}"
            )
        if record.error:
            problems.append(f"{record.run_id}: {record.error}")
    return problems


def _short(seqs: list[int]) -> str:
    return str(seqs) if len(seqs) <= 12 else f"{seqs[:6]}…{seqs[-6:]} ({len(seqs)})"


def judge(
    database_url: str,
    records: list[RunRecord],
    worker_kills: list[WorkerKill],
    worker_addresses: list[str],
    kafka: tuple[str, str],
) -> Verdict:
    verdict = Verdict()
    report = invariants(database_url)
    broken = report.broken()
    verdict.stuck_run_ids = broken.pop("stuck", [])
    for name, run_ids in broken.items():
        verdict.add(name, run_ids)
    run_ids = [r.run_id for r in records if r.run_id is not None]
    stored = stored_events(database_url, run_ids)
    verdict.add("delivery", delivery_problems(records, stored))
    on_topic = published(*kafka, sum(len(events) for events in stored.values()))
    verdict.add(
        "not_on_topic",
        [
            f"{run_id} seq {seq}"
            for run_id, events in stored.items()
            for seq, _, _ in events
            if (run_id, seq) not in on_topic
        ],
    )
    verdict.add("busy_pool", [f"{a}: {s}" for a, s in wait_pools_free(worker_addresses).items()])
    for kill in worker_kills:
        verdict.settle_seconds.extend(settled_after(database_url, kill.run_ids, kill.at).values())
    return verdict


def wait_pools_free(addresses: list[str], timeout: float = 15.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        busy = busy_workers(addresses)
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.5)
