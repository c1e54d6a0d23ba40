"""`tollgate reconcile` against a real database: exit 0 when every invariant holds, 1 and
the broken invariant's runs when one does not."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import sqlalchemy as sa

from services.core.db import open_db
from services.core.event_store import EventStore
from services.core.schema import runs
from tests.services.ledger.runs import create_tenant, queued_run
from tollgate.cli import main


async def _queued(database_url: str, *, age_minutes: int = 0) -> str:
    db = open_db(database_url, pool_size=2)
    try:
        tenant, _ = await create_tenant(db)
        run_id = await queued_run(EventStore(db), tenant)
        async with db.begin() as conn:
            await conn.execute(
                runs.update()
                .where(runs.c.run_id == run_id)
                .values(created_at=runs.c.created_at - sa.text(f"interval '{age_minutes} minutes'"))
            )
        return run_id
    finally:
        await db.dispose()


def test_reconcile_exits_0_when_all_holds_and_1_naming_a_stuck_run(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    asyncio.run(_queued(database_url))
    assert main(["reconcile", "--database-url", database_url]) == 0
    assert capsys.readouterr().out.startswith("ok: every invariant holds")

    stuck = asyncio.run(_queued(database_url, age_minutes=30))
    (tmp_path / "stack.json").write_text(json.dumps({"database_url": database_url}))
    assert main(["reconcile", "--data-dir", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["broken"] == {"stuck": [stuck]}
    assert main(["reconcile", "--database-url", database_url, "--since", "10m"]) == 0
    assert main(["reconcile", "--database-url", database_url, "--stuck-after", "1h"]) == 0
