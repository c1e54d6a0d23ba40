"""The invariants of runs and their billing, checked in the database.

One place for the queries behind `LedgerService.GetReconciliation` and
`tollgate reconcile`. Each names the runs that break one invariant:

* unbilled: terminal for longer than the sweep's grace, and not billed;
* unreleased: billed, with their KV reservation still held;
* mismatched: billed, with entries that do not add up to their `billed` event;
* misended: not exactly one terminal event and then one `billed`, the last event;
* seq_gap: events not numbered 1..last_seq without a gap;
* double_billed: more than one ledger entry for one (tenant, idempotency key, billing type);
* token_mismatch: billed output tokens other than the tokens their `streaming` events carry;
* stuck: not ended within `stuck_after` seconds of their creation.

Whether workers' pools are free when idle is not in the database (workers keep their
pools in memory and report them to the scheduler only), so it is not checked here.
Every list holds at most MAX_REPORTED_RUNS ids, oldest or smallest first.

Every query starts from the runs in scope (`runs` by tenant and creation time, through
its tenant indexes) and reads only their events, entries and reservations (by run id,
through the tables' run indexes): a tenant's check costs what its runs cost, never a
pass over every tenant's events. A tenant's own call (GetReconciliation with its key)
covers its runs of the last TENANT_WINDOW_SECONDS; the operator's covers everything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from services.core.db import Database
from services.core.pricing import BILLING_TYPES, OUTPUT_TOKENS
from services.core.runs import ENDED_STATES, TERMINAL_STATES, RunState
from services.core.schema import kv_reservations, ledger_entries, run_events, runs
from services.ledger.ledger_store import MAX_REPORTED_RUNS, overdue_run_ids

_TERMINAL = sorted(str(state) for state in TERMINAL_STATES)
_ENDED = sorted(str(state) for state in ENDED_STATES)
_BILLED = str(RunState.BILLED)
# A run not ended this long after its creation is stuck, unless told otherwise.
DEFAULT_STUCK_AFTER_SECONDS = 600.0
# How far back a tenant's own GetReconciliation looks: its runs created in the last week.
TENANT_WINDOW_SECONDS = 7 * 86400.0


@dataclass(frozen=True, slots=True)
class Scope:
    """Which runs to check: one tenant's (None: all) created in the last `since_seconds`
    (None: ever)."""

    tenant_id: str | None = None
    since_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class InvariantReport:
    unbilled_run_ids: list[str]
    unreleased_run_ids: list[str]
    mismatched_run_ids: list[str]
    misended_run_ids: list[str]
    seq_gap_run_ids: list[str]
    double_billed_run_ids: list[str]
    token_mismatch_run_ids: list[str]
    stuck_run_ids: list[str]

    @property
    def ok(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))

    def broken(self) -> dict[str, list[str]]:
        """The invariants broken, by name (the field less `_run_ids`), with their runs."""
        return {name.removesuffix("_run_ids"): ids for name, ids in asdict(self).items() if ids}


async def check(
    db: Database,
    scope: Scope,
    *,
    unbilled_grace: float,
    stuck_after: float = DEFAULT_STUCK_AFTER_SECONDS,
) -> InvariantReport:
    """Every invariant over the runs in `scope`, in one snapshot."""
    async with db.connect() as conn:
        await conn.execute(sa.text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY"))
        scoped = _scoped(scope)
        return InvariantReport(
            unbilled_run_ids=await _unbilled(conn, scope, unbilled_grace),
            unreleased_run_ids=await _ids(conn, _unreleased(scoped, scope.tenant_id)),
            mismatched_run_ids=await _ids(conn, _mismatched(scoped)),
            misended_run_ids=await _ids(conn, _misended(scoped)),
            seq_gap_run_ids=await _ids(conn, _seq_gaps(scoped)),
            double_billed_run_ids=await _ids(conn, _double_billed(scoped)),
            token_mismatch_run_ids=await _ids(conn, _token_mismatch(scoped)),
            stuck_run_ids=await _ids(conn, _stuck(scoped, stuck_after)),
        )


def _ago(seconds: float) -> sa.ColumnElement[datetime]:
    return sa.func.now() - sa.literal_column("interval '1 second'") * float(seconds)


def _scoped(scope: Scope) -> sa.Subquery:
    """The runs in scope, with what the checks read of them: the one pass over `runs`."""
    query = sa.select(runs.c.run_id, runs.c.state, runs.c.last_seq, runs.c.created_at)
    if scope.tenant_id is not None:
        query = query.where(runs.c.tenant_id == scope.tenant_id)
    if scope.since_seconds is not None:
        query = query.where(runs.c.created_at >= _ago(scope.since_seconds))
    return query.subquery("scoped")


async def _ids(conn: AsyncConnection, query: sa.Select[tuple[str]]) -> list[str]:
    subquery = query.subquery()
    ordered = sa.select(subquery.c.run_id).distinct().order_by(subquery.c.run_id)
    return list((await conn.scalars(ordered.limit(MAX_REPORTED_RUNS))).all())


async def _unbilled(conn: AsyncConnection, scope: Scope, grace: float) -> list[str]:
    # The sweep's own query, so the report and the sweep agree on what is overdue.
    return await overdue_run_ids(
        conn, grace, scope.tenant_id, created_since_seconds=scope.since_seconds
    )


def _in(scoped: sa.Subquery, column: sa.ColumnElement[str]) -> sa.ColumnElement[bool]:
    return column.in_(sa.select(scoped.c.run_id))


def _unreleased(scoped: sa.Subquery, tenant_id: str | None) -> sa.Select[tuple[str]]:
    query = (
        sa.select(scoped.c.run_id)
        .join(kv_reservations, kv_reservations.c.run_id == scoped.c.run_id)
        .where(scoped.c.state == _BILLED, kv_reservations.c.released_at.is_(None))
    )
    if tenant_id is not None:
        # The tenant's held reservations (index kv_reservations_open), not every tenant's.
        query = query.where(kv_reservations.c.tenant_id == tenant_id)
    return query


def _mismatched(scoped: sa.Subquery) -> sa.Select[tuple[str]]:
    totals = (
        sa.select(
            ledger_entries.c.run_id,
            sa.func.count().label("num_entries"),
            sa.func.sum(ledger_entries.c.amount_micros).label("amount_micros"),
        )
        .where(_in(scoped, ledger_entries.c.run_id))
        .group_by(ledger_entries.c.run_id)
        .subquery()
    )
    billed_amount = sa.cast(run_events.c.payload["amount_micros"].astext, sa.BigInteger)
    return (
        sa.select(scoped.c.run_id)
        .join(
            run_events,
            sa.and_(run_events.c.run_id == scoped.c.run_id, run_events.c.kind == _BILLED),
        )
        .outerjoin(totals, totals.c.run_id == scoped.c.run_id)
        .where(
            scoped.c.state == _BILLED,
            sa.or_(
                sa.func.coalesce(totals.c.num_entries, 0) != len(BILLING_TYPES),
                sa.func.coalesce(totals.c.amount_micros, 0) != sa.func.coalesce(billed_amount, 0),
            ),
        )
    )


def _count_of(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
    return sa.func.count().filter(condition)


def _misended(scoped: sa.Subquery) -> sa.Select[tuple[str]]:
    kind, seq = run_events.c.kind, run_events.c.seq
    num_terminal = _count_of(kind.in_(_TERMINAL))
    num_billed = _count_of(kind == _BILLED)
    billed_seq = sa.func.max(seq).filter(kind == _BILLED)
    return (
        sa.select(run_events.c.run_id)
        .where(_in(scoped, run_events.c.run_id))
        .group_by(run_events.c.run_id)
        .having(
            sa.or_(
                num_terminal > 1,
                num_billed > 1,
                sa.and_(num_billed == 1, sa.or_(num_terminal != 1, billed_seq != sa.func.max(seq))),
            )
        )
    )


def _seq_gaps(scoped: sa.Subquery) -> sa.Select[tuple[str]]:
    numbered = (
        sa.select(
            run_events.c.run_id,
            sa.func.count().label("num_events"),
            sa.func.min(run_events.c.seq).label("first_seq"),
            sa.func.max(run_events.c.seq).label("last_seq"),
        )
        .where(_in(scoped, run_events.c.run_id))
        .group_by(run_events.c.run_id)
        .subquery()
    )
    return (
        sa.select(scoped.c.run_id)
        .outerjoin(numbered, numbered.c.run_id == scoped.c.run_id)
        .where(
            sa.or_(
                numbered.c.num_events.is_(None),
                numbered.c.first_seq != 1,
                numbered.c.last_seq != numbered.c.num_events,
                numbered.c.last_seq != scoped.c.last_seq,
            ),
        )
    )


def _double_billed(scoped: sa.Subquery) -> sa.Select[tuple[str]]:
    # A run's idempotency key is its tenant's alone (runs_tenant_idempotency_key), so the
    # entries of one key are those of the run holding it.
    key = (ledger_entries.c.tenant_id, ledger_entries.c.idempotency_key)
    repeated = (
        sa.select(*key, ledger_entries.c.billing_type)
        .where(_in(scoped, ledger_entries.c.run_id))
        .group_by(*key, ledger_entries.c.billing_type)
        .having(sa.func.count() > 1)
        .subquery()
    )
    return (
        sa.select(ledger_entries.c.run_id)
        .join(
            repeated,
            sa.and_(
                repeated.c.tenant_id == ledger_entries.c.tenant_id,
                repeated.c.idempotency_key == ledger_entries.c.idempotency_key,
                repeated.c.billing_type == ledger_entries.c.billing_type,
            ),
        )
        .where(_in(scoped, ledger_entries.c.run_id))
    )


# The tokens of a `streaming` event, read from its stored text: PostgreSQL's JSON
# operators refuse a payload whose text holds an escaped NUL, which a model may emit.
_TOKEN_IDS = r'"token_ids":\s*\[([^\]]*)\]'


def streamed_tokens(payload: sa.ColumnElement[object]) -> sa.ColumnElement[int]:
    listed = sa.func.nullif(sa.func.substring(sa.cast(payload, sa.Text), _TOKEN_IDS), "")
    return sa.func.coalesce(sa.func.array_length(sa.func.string_to_array(listed, ","), 1), 0)


def _token_mismatch(scoped: sa.Subquery) -> sa.Select[tuple[str]]:
    streamed = (
        sa.select(
            run_events.c.run_id,
            sa.func.sum(streamed_tokens(run_events.c.payload)).label("num_tokens"),
        )
        .where(run_events.c.kind == str(RunState.STREAMING), _in(scoped, run_events.c.run_id))
        .group_by(run_events.c.run_id)
        .subquery()
    )
    return (
        sa.select(ledger_entries.c.run_id)
        .outerjoin(streamed, streamed.c.run_id == ledger_entries.c.run_id)
        .where(
            _in(scoped, ledger_entries.c.run_id),
            ledger_entries.c.billing_type == OUTPUT_TOKENS,
            ledger_entries.c.quantity != sa.func.coalesce(streamed.c.num_tokens, 0),
        )
    )


def _stuck(scoped: sa.Subquery, stuck_after: float) -> sa.Select[tuple[str]]:
    return sa.select(scoped.c.run_id).where(
        scoped.c.state.not_in(_ENDED), scoped.c.created_at < _ago(stuck_after)
    )
