"""The operator's side of the console's JSON, behind the admin token."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from services.console import report_store
from services.core.db import open_db
from services.core.event_store import EventStore
from services.core.runs import NewEvent, RunState
from services.core.schema import run_events
from tests.services.admission.running import ADMIN_TOKEN
from tests.services.console.conftest import ConsoleServer
from tests.services.console.test_tenant_api import billed_run
from tests.services.ledger.runs import age_runs, queued_run, terminal_run, usage

OPERATOR_PATHS = [
    "/console/api/fleet",
    "/console/api/latency",
    "/console/api/top-tenants",
    "/console/api/relay",
    "/console/api/reconciliation",
    "/console/api/tenants",
]


@pytest.mark.parametrize("path", OPERATOR_PATHS)
async def test_operator_figures_need_the_admin_token(console: ConsoleServer, path: str) -> None:
    _, key = await console.admission.new_tenant_key(f"console-op-{path.rsplit('/', 1)[-1]}")
    denied = await console.call(path, key)
    assert denied.status == 403 and "admin token" in denied.json()["error"]["message"]
    assert (await console.call(path)).status == 401
    assert (await console.call(path, ADMIN_TOKEN)).status == 200


async def test_without_a_scheduler_the_fleet_reads_unavailable(console: ConsoleServer) -> None:
    fleet = await console.json("/console/api/fleet", ADMIN_TOKEN)
    assert fleet == {"available": False, "queues": {}, "workers": []}


async def timed_run(store: EventStore, tenant_id: str, offsets: list[float]) -> str:
    """A run queued at 0 that streamed 1, 2 and 1 tokens at offsets[1:] seconds (prefill
    in between), then completed: its events' times set as given."""
    run_id = await queued_run(store, tenant_id)
    # A NUL in the text, as a model may emit: PostgreSQL's JSON operators refuse it.
    steps = [([1], "x"), ([2, 3], "\x00"), ([4], "y")]
    await store.append(
        run_id,
        1,
        [
            NewEvent(RunState.PREFILL),
            *(NewEvent(RunState.STREAMING, {"token_ids": t, "text": x}) for t, x in steps),
            NewEvent(RunState.COMPLETED, {"finish_reason": "length", "usage": usage(3, 0, 4)}),
        ],
    )
    # seq: 1 queued, 2 prefill, 3..5 streaming, 6 completed.
    times = [offsets[0], offsets[0] + 0.01, *offsets[1:], offsets[-1] + 0.01]
    async with store.db.begin() as conn:
        for seq, at in enumerate(times, start=1):
            when = sa.func.now() - sa.text("interval '10 seconds'") + sa.text(f"interval '{at} s'")
            await conn.execute(
                run_events.update()
                .where(run_events.c.run_id == run_id, run_events.c.seq == seq)
                .values(created_at=when)
            )
    return run_id


async def test_latency_is_ttft_and_per_token_itl_from_the_events(console: ConsoleServer) -> None:
    tenant_id, _ = await console.admission.new_tenant_key("console-latency")
    # TTFT 0.2 s; the 2-token step 0.2 s after the first (ITL 0.1), the last 0.05 s later.
    await timed_run(console.admission.store, tenant_id, [0.0, 0.2, 0.4, 0.45])
    latency = await console.json("/console/api/latency?minutes=1", ADMIN_TOKEN)
    assert latency["num_runs"] == 1 and latency["num_output_tokens"] == 4
    assert latency["ttft_p50"] == pytest.approx(0.2) and latency["ttft_p99"] == pytest.approx(0.2)
    assert latency["itl_p50"] == pytest.approx(0.075)
    assert latency["itl_p99"] == pytest.approx(0.0995)
    assert latency["tokens_per_second"] == pytest.approx(4 / 60)
    refused = await console.call("/console/api/latency?minutes=0", ADMIN_TOKEN)
    assert refused.status == 400 and refused.json()["error"]["param"] == "minutes"


async def test_no_runs_gives_no_latency(console: ConsoleServer) -> None:
    latency = await console.json("/console/api/latency", ADMIN_TOKEN)
    assert latency["num_runs"] == 0 and latency["ttft_p50"] is None
    assert latency["tokens_per_second"] == 0


async def test_top_tenants_by_spend_with_their_tokens(console: ConsoleServer) -> None:
    small_id, _ = await console.admission.new_tenant_key("console-small")
    big_id, _ = await console.admission.new_tenant_key("console-big")
    await billed_run(console, small_id, output=1)
    await billed_run(console, big_id, output=50)
    await billed_run(console, big_id, output=50)
    top = await console.json("/console/api/top-tenants?limit=5", ADMIN_TOKEN)
    assert [(t["tenant_id"], t["name"]) for t in top["tenants"]] == [
        (big_id, "console-big"),
        (small_id, "console-small"),
    ]
    # 10 prompt tokens (6 uncached, 4 cached) and the output, per run.
    assert [t["num_tokens"] for t in top["tenants"]] == [2 * (10 + 50), 10 + 1]
    assert top["tenants"][0]["amount_micros"] == 2 * (6 * 2 + 4 + 50 * 8)
    one = await console.json("/console/api/top-tenants?limit=1", ADMIN_TOKEN)
    assert [t["tenant_id"] for t in one["tenants"]] == [big_id]


async def test_relay_lag_is_the_age_of_the_oldest_unpublished_event(database_url: str) -> None:
    # No relay runs on this database: what is appended stays unpublished.
    db = open_db(database_url)
    try:
        store = EventStore(db)
        assert await report_store.relay_lag(db) == report_store.RelayLag(0, 0.0)
        run_id = await queued_run(store, "t1")
        await queued_run(store, "t1")
        async with db.begin() as conn:
            await conn.execute(
                run_events.update()
                .where(run_events.c.run_id == run_id)
                .values(created_at=sa.func.now() - sa.text("interval '90 seconds'"))
            )
        lag = await report_store.relay_lag(db)
        assert lag.num_unpublished == 2
        assert 90 <= lag.oldest_age_seconds < 120
    finally:
        await db.dispose()


async def test_reconciliation_reports_a_run_left_unbilled(console: ConsoleServer) -> None:
    tenant_id, _ = await console.admission.new_tenant_key("console-reconcile")
    await billed_run(console, tenant_id)
    assert (await console.json("/console/api/reconciliation", ADMIN_TOKEN))["ok"] is True
    run_id = await terminal_run(console.admission.store, tenant_id)
    await age_runs(console.admission.db, 60)  # past the ledger's grace
    report = await console.json("/console/api/reconciliation", ADMIN_TOKEN)
    assert report["ok"] is False
    assert report["broken"]["unbilled"] == {"num_runs": 1, "run_ids": [run_id]}


async def test_keys_are_made_shown_once_and_revoked_with_the_admin_token(
    console: ConsoleServer,
) -> None:
    tenant_id, tenant_key = await console.admission.new_tenant_key("console-keys")
    tenants = await console.json("/console/api/tenants", ADMIN_TOKEN)
    assert {"tenant_id": tenant_id, "name": "console-keys"} in tenants["tenants"]
    made = await console.json(f"/console/api/tenants/{tenant_id}/keys", ADMIN_TOKEN, "POST")
    assert made["tenant_id"] == tenant_id and made["secret"].startswith("tg_")
    session = await console.json("/console/api/session", made["secret"])
    assert session["tenant_id"] == tenant_id
    denied = await console.call(f"/console/api/tenants/{tenant_id}/keys", tenant_key, "POST")
    assert denied.status == 403
    revoked = await console.json(f"/console/api/keys/{made['key_id']}/revoke", ADMIN_TOKEN, "POST")
    assert revoked == {"key_id": made["key_id"], "tenant_id": tenant_id, "revoked": True}
    assert (await console.call("/console/api/session", made["secret"])).status == 401
    unknown = await console.call("/console/api/tenants/ten_nobody/keys", ADMIN_TOKEN, "POST")
    assert unknown.status == 404
