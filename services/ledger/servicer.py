"""`LedgerService`: protobuf in, the ledger's reports out."""

from __future__ import annotations

from datetime import UTC, datetime

import grpc
from google.protobuf import timestamp_pb2

from services.core.auth import Principal, authenticate
from services.core.db import Database
from services.core.errors import InvalidArgument
from services.core.grpc_errors import rpc_errors
from services.core.pricing import LedgerEntry
from services.core.ratelimit import FailedAttempts
from services.core.validation import timestamp_violation
from services.ledger import reconcile, reports
from tollgate.v1 import events_pb2, ledger_pb2, ledger_pb2_grpc


class LedgerServicer(ledger_pb2_grpc.LedgerServiceServicer):
    def __init__(
        self,
        db: Database,
        *,
        admin_token: str,
        currency: str,
        sweep_grace: float,
        stuck_after: float = reconcile.DEFAULT_STUCK_AFTER_SECONDS,
    ) -> None:
        self.db = db
        self.admin_token = admin_token
        self.currency = currency
        self.sweep_grace = sweep_grace
        self.stuck_after = stuck_after
        # Failed authentications per peer: a guesser is slowed here as at the gateway.
        self.auth_failures = FailedAttempts()

    async def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        return await authenticate(
            self.db,
            context.invocation_metadata(),
            admin_token=self.admin_token,
            allow_admin=True,
            peer=context.peer(),
            failures=self.auth_failures,
        )

    @rpc_errors
    async def ListLedgerEntries(
        self, request: ledger_pb2.ListLedgerEntriesRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.ListLedgerEntriesResponse:
        tenant_id = reports.visible_tenant(await self._principal(context), request.tenant_id)
        page = await reports.list_entries(
            self.db, tenant_id, request.run_id, request.page_size, request.page_token
        )
        return ledger_pb2.ListLedgerEntriesResponse(
            entries=[entry_to_proto(entry) for entry in page.entries],
            next_page_token=page.next_page_token,
        )

    @rpc_errors
    async def GetUsage(
        self, request: ledger_pb2.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.GetUsageResponse:
        principal = await self._principal(context)
        tenant_id = reports.visible_tenant(principal, request.tenant_id)
        usage = await reports.usage(
            self.db,
            tenant_id,
            _time(request, "start_time"),
            _time(request, "end_time"),
            self.currency,
        )
        return ledger_pb2.GetUsageResponse(
            tenant_id=usage.tenant_id or "",
            num_runs=usage.num_runs,
            lines=[
                ledger_pb2.UsageLine(
                    billing_type=line.billing_type,
                    quantity=line.quantity,
                    amount_micros=line.amount_micros,
                )
                for line in usage.lines
            ],
            amount_micros=usage.amount_micros,
            currency=usage.currency,
            limits=[
                limit_to_proto(standing)
                for standing in (
                    await reports.limits(self.db, tenant_id, principal.key_id or "")
                    if tenant_id
                    else []
                )
            ],
        )

    @rpc_errors
    async def GetReconciliation(
        self, request: ledger_pb2.GetReconciliationRequest, context: grpc.aio.ServicerContext
    ) -> ledger_pb2.Reconciliation:
        tenant_id = reports.visible_tenant(await self._principal(context), "")
        # A tenant's key checks its recent runs; the admin token, every run.
        since = None if tenant_id is None else reconcile.TENANT_WINDOW_SECONDS
        report = await reconcile.check(
            self.db,
            reconcile.Scope(tenant_id, since),
            unbilled_grace=self.sweep_grace,
            stuck_after=self.stuck_after,
        )
        return reconciliation_to_proto(report)


def _time(request: ledger_pb2.GetUsageRequest, name: str) -> datetime | None:
    if not request.HasField(name):
        return None
    stamp: timestamp_pb2.Timestamp = getattr(request, name)
    out_of_range = timestamp_violation(name, stamp.seconds, stamp.nanos)
    if out_of_range is not None:
        raise InvalidArgument([out_of_range])
    return stamp.ToDatetime(tzinfo=UTC)


def reconciliation_to_proto(report: reconcile.InvariantReport) -> ledger_pb2.Reconciliation:
    """The report in the message's four lists: every way a billed run's accounts or events
    do not add up counts as mismatched."""
    mismatched = {
        *report.mismatched_run_ids,
        *report.misended_run_ids,
        *report.seq_gap_run_ids,
        *report.double_billed_run_ids,
        *report.token_mismatch_run_ids,
    }
    return ledger_pb2.Reconciliation(
        ok=report.ok,
        unbilled_run_ids=report.unbilled_run_ids,
        unreleased_run_ids=report.unreleased_run_ids,
        mismatched_run_ids=sorted(mismatched),
        stuck_run_ids=report.stuck_run_ids,
    )


def limit_to_proto(standing: reports.LimitStanding) -> ledger_pb2.LimitUsage:
    message = ledger_pb2.LimitUsage(
        subject=standing.subject,
        name=standing.name,
        limit=standing.limit,
        used=standing.used,
        remaining=standing.remaining,
        budget_period=standing.budget_period,
    )
    if standing.reset_time is not None:
        message.reset_time.FromDatetime(standing.reset_time)
    return message


def entry_to_proto(entry: LedgerEntry) -> events_pb2.LedgerEntry:
    message = events_pb2.LedgerEntry(
        entry_id=entry.entry_id,
        tenant_id=entry.tenant_id,
        run_id=entry.run_id,
        idempotency_key=entry.idempotency_key,
        billing_type=entry.billing_type,
        quantity=entry.quantity,
        unit_price_micros=entry.unit_price_micros,
        amount_micros=entry.amount_micros,
        discount_micros=entry.discount_micros,
    )
    if entry.created_at is not None:
        message.create_time.FromDatetime(entry.created_at)
    return message
