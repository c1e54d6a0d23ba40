"""Admission throughput with every limit configured, against none, in the same run.

Two tenants on one embedded PostgreSQL: one without limits, one with every limit of
its own and of its key (rates, tokens, a budget, runs and KV blocks in flight), all set
high enough that nothing is refused. Writers admit runs through admission's own
transaction (`services.admission.admit.admit`), the two tenants in alternating rounds
so that a drift of the machine falls on both. The figure is the ratio of admitted runs
per second, limited over unlimited (target >= 0.9).

    python -m bench.quotas [--runs 400] [--writers 8] [--rounds 2]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from bench.report import logs_to_stderr, progress
from services.admission.admit import Admission, Held, admit
from services.admission.checks import Candidate, Checks
from services.admission.requests import GenerateParams, Sampling
from services.admission.tenant_store import TenantStore
from services.core.db import Database, open_db
from services.core.errors import ApiError
from services.core.quotas import QuotaLimits
from services.stack.infra import LocalInfra

PROMPT = list(range(32))
MAX_TOKENS = 16
HIGH = 10**9
EVERY_LIMIT = QuotaLimits(
    requests_per_minute=HIGH,
    input_tokens_per_minute=HIGH,
    output_tokens_per_minute=HIGH,
    budget_micros=HIGH,
    budget_period="month",
    max_concurrent_runs=HIGH,
    max_kv_blocks=HIGH,
)


async def tenant(tenants: TenantStore, name: str, limited: bool) -> tuple[str, str]:
    """(tenant_id, key_id) of a new tenant, with every limit set when `limited`."""
    record = await tenants.create(name, 1)
    key = await tenants.create_key(record.tenant_id)
    if limited:
        await tenants.set_quota(record.tenant_id, HIGH, HIGH, None, EVERY_LIMIT)
        await tenants.set_key_quota(record.tenant_id, key.key_id, EVERY_LIMIT)
    return record.tenant_id, key.key_id


async def admit_many(db: Database, tenant_id: str, key_id: str, runs: int, writers: int) -> float:
    """Admitted runs per second, `writers` admissions at a time."""
    params = GenerateParams(
        "tiny", "p", (), Sampling(max_tokens=MAX_TOKENS), "interactive", "", 30.0
    )
    queue = iter(range(runs))

    async def writer() -> None:
        for _ in queue:
            admission = Admission(
                run_id=f"run_{uuid.uuid4().hex}",
                tenant_id=tenant_id,
                params=params,
                prompt_token_ids=PROMPT,
                num_kv_blocks=3,
                key_id=key_id,
                spend_micros=len(PROMPT) * 2 + MAX_TOKENS * 8,
            )
            await admit(db, admission, on_hold(Candidate(tenant_id, key_id, params, admission)))

    started = time.perf_counter()
    await asyncio.gather(*(writer() for _ in range(writers)))
    return runs / (time.perf_counter() - started)


def on_hold(run: Candidate) -> Callable[[Held], Awaitable[ApiError | None]]:
    """Admission's checks under the tenant's lock (checks.py's `on_hold` stage)."""

    async def refuse(held: Held) -> ApiError | None:
        stage = (Checks.run_size, Checks.quotas)
        return await Checks.first_refusal(stage, replace(run, held=held))

    return refuse


async def bench(args: argparse.Namespace, database_url: str) -> dict[str, float]:
    db = open_db(database_url, pool_size=args.writers)
    try:
        tenants = TenantStore(db, default_max_concurrent_runs=0)
        unlimited = await tenant(tenants, "unlimited", limited=False)
        limited = await tenant(tenants, "limited", limited=True)
        rates: dict[str, list[float]] = {"unlimited": [], "limited": []}
        for n in range(args.rounds):
            for name, (tenant_id, key_id) in (("unlimited", unlimited), ("limited", limited)):
                rate = await admit_many(db, tenant_id, key_id, args.runs, args.writers)
                progress(f"round {n + 1} {name}: {rate:.1f} admitted runs/s")
                rates[name].append(rate)
    finally:
        await db.dispose()
    free, bound = sum(rates["unlimited"]), sum(rates["limited"])
    return {
        "unlimited_admitted_runs_per_second": round(free / args.rounds, 1),
        "limited_admitted_runs_per_second": round(bound / args.rounds, 1),
        "limited_over_unlimited": round(bound / free, 3),
        "target": 0.9,
        "runs_per_round": args.runs,
        "writers": args.writers,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=400, help="runs per tenant per round")
    parser.add_argument("--writers", type=int, default=8, help="concurrent admissions")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logs_to_stderr()
    with tempfile.TemporaryDirectory(prefix="tollgate-bench-") as tmp:
        with LocalInfra(Path(tmp)) as endpoints:
            figures = asyncio.run(bench(args, endpoints.database_url))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
