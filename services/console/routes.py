"""The console's routes on admission's HTTP server: the page at `/console`, its files, and
the JSON it reads under `/console/api/`. A tenant's calls take its API key, the
operator's the admin token, both as `authorization: Bearer`, checked as the gRPC
services check them (constant-time for the admin token). Errors are the HTTP API's
OpenAI-style bodies. None of it is in `/openapi.json`: it is the console's own API."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response

from services.admission.gateway import Gateway
from services.admission.http.responses import run_json
from services.admission.key_store import KeyStore
from services.admission.run_store import MAX_PAGE_SIZE, list_runs
from services.admission.scheduler_client import SchedulerClient
from services.admission.tenant_store import TenantStore
from services.console import assets, report_store
from services.console.usage import MAX_DAYS, daily_usage
from services.console.views import (
    day_json,
    fleet_json,
    latency_json,
    reconciliation_json,
    tenant_total_json,
)
from services.core.auth import Principal, authenticate
from services.core.errors import NotFound, PermissionDenied
from services.ledger import reconcile, reports

MAX_MINUTES = 24 * 60
MAX_TOP_TENANTS = 100
# Reconciliation reads every run in its window: a day keeps the console's check cheap
# (`tollgate reconcile` checks every run).
RECONCILE_WINDOW_SECONDS = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class ConsoleSettings:
    admin_token: str
    currency: str
    # As the ledger's (TOLLGATE_LEDGER_SWEEP_GRACE, TOLLGATE_LEDGER_STUCK_SECONDS).
    unbilled_grace: float
    stuck_after: float = reconcile.DEFAULT_STUCK_AFTER_SECONDS

    @classmethod
    def from_env(cls, admin_token: str) -> ConsoleSettings:
        """The ledger's own reading of its variables, so both report alike."""
        from services.ledger.app import LedgerSettings

        ledger = LedgerSettings.from_env()
        return cls(admin_token, ledger.prices.currency, ledger.sweep_grace, ledger.stuck_after)


def console_router(
    gateway: Gateway, settings: ConsoleSettings, scheduler: SchedulerClient | None
) -> APIRouter:
    console = Console(gateway, settings, scheduler)
    router = APIRouter(include_in_schema=False)
    router.get("/console")(console.page)
    router.get("/console/")(console.page)
    router.get("/console/static/{name}")(console.static)
    router.get("/console/api/session")(console.session)
    router.get("/console/api/runs")(console.runs)
    router.get("/console/api/usage")(console.usage)
    router.get("/console/api/fleet")(console.fleet)
    router.get("/console/api/latency")(console.latency)
    router.get("/console/api/top-tenants")(console.top_tenants)
    router.get("/console/api/relay")(console.relay)
    router.get("/console/api/reconciliation")(console.reconciliation)
    router.get("/console/api/tenants")(console.tenants)
    router.post("/console/api/tenants/{tenant_id}/keys")(console.create_key)
    router.post("/console/api/keys/{key_id}/revoke")(console.revoke_key)
    return router


class Console:
    def __init__(
        self, gateway: Gateway, settings: ConsoleSettings, scheduler: SchedulerClient | None
    ) -> None:
        self.gateway = gateway
        self.settings = settings
        self.scheduler = scheduler
        self.tenant_store = TenantStore(gateway.db)
        self.keys = KeyStore(gateway.db, gateway.key_cache)

    async def page(self, request: Request) -> Response:
        if request.url.path.endswith("/"):
            return RedirectResponse("/console", 308)
        return self._file(assets.INDEX)

    async def static(self, name: str) -> Response:
        return self._file(name)

    async def session(self, request: Request) -> dict[str, Any]:
        """Who the secret signs in as: a tenant (with its name) or the operator."""
        principal = await self._principal(request)
        if principal.is_admin:
            return {"role": "operator", "currency": self.settings.currency}
        assert principal.tenant_id is not None
        tenant = await self.tenant_store.get(principal.tenant_id)
        return {
            "role": "tenant",
            "tenant_id": tenant.tenant_id,
            "tenant_name": tenant.name,
            "currency": self.settings.currency,
        }

    async def runs(
        self,
        request: Request,
        page_size: Annotated[int, Query(ge=0, le=MAX_PAGE_SIZE)] = 0,
        page_token: Annotated[str, Query(max_length=1024)] = "",
    ) -> dict[str, Any]:
        """The tenant's runs, newest first: ListRuns as JSON."""
        principal = await self._tenant(request)
        page, token = await list_runs(self.gateway.db, principal, page_size, page_token)
        return {"runs": [run_json(run) for run in page], "next_page_token": token}

    async def usage(
        self,
        request: Request,
        days: Annotated[int, Query(ge=1, le=MAX_DAYS)] = 14,
        tenant_id: Annotated[str, Query(max_length=128)] = "",
    ) -> dict[str, Any]:
        """Usage and spend per UTC day: a tenant's own, or (admin token) one tenant's or
        everyone's."""
        visible = reports.visible_tenant(await self._principal(request), tenant_id)
        today = datetime.now(UTC).date()
        lines = await daily_usage(self.gateway.db, visible, days, self.settings.currency, today)
        return {
            "tenant_id": visible or "",
            "currency": self.settings.currency,
            "days": [day_json(day) for day in lines],
        }

    async def fleet(self, request: Request) -> dict[str, Any]:
        """Queue depth per class and each worker's KV blocks and running runs, from the
        scheduler; `available` false when it does not answer."""
        await self._operator(request)
        fleet = await self.scheduler.fleet() if self.scheduler is not None else None
        return fleet_json(fleet)

    async def latency(
        self, request: Request, minutes: Annotated[float, Query(gt=0, le=MAX_MINUTES)] = 5
    ) -> dict[str, Any]:
        await self._operator(request)
        return latency_json(await report_store.latency(self.gateway.db, minutes * 60))

    async def top_tenants(
        self,
        request: Request,
        hours: Annotated[float, Query(gt=0, le=MAX_DAYS * 24)] = 24,
        limit: Annotated[int, Query(ge=1, le=MAX_TOP_TENANTS)] = 10,
    ) -> dict[str, Any]:
        await self._operator(request)
        totals = await report_store.top_tenants(self.gateway.db, hours * 3600, limit)
        return {
            "window_seconds": hours * 3600,
            "currency": self.settings.currency,
            "tenants": [tenant_total_json(t) for t in totals],
        }

    async def relay(self, request: Request) -> dict[str, Any]:
        """The outbox relay's lag: events committed and not yet on Kafka."""
        await self._operator(request)
        lag = await report_store.relay_lag(self.gateway.db)
        return {
            "num_unpublished": lag.num_unpublished,
            "oldest_age_seconds": lag.oldest_age_seconds,
        }

    async def reconciliation(self, request: Request) -> dict[str, Any]:
        """The ledger's invariant report over the runs of the last day."""
        await self._operator(request)
        report = await reconcile.check(
            self.gateway.db,
            reconcile.Scope(since_seconds=RECONCILE_WINDOW_SECONDS),
            unbilled_grace=self.settings.unbilled_grace,
            stuck_after=self.settings.stuck_after,
        )
        return reconciliation_json(report, RECONCILE_WINDOW_SECONDS)

    async def tenants(self, request: Request) -> dict[str, Any]:
        await self._operator(request)
        found = await self.tenant_store.list()
        return {"tenants": [{"tenant_id": t.tenant_id, "name": t.name} for t in found]}

    async def create_key(self, tenant_id: str, request: Request) -> dict[str, Any]:
        """A new key for the tenant; its secret is in this answer only."""
        await self._operator(request)
        key = await self.keys.create(tenant_id)
        return {"key_id": key.key_id, "tenant_id": key.tenant_id, "secret": key.secret}

    async def revoke_key(self, key_id: str, request: Request) -> dict[str, Any]:
        await self._operator(request)
        key = await self.keys.revoke(key_id)
        return {"key_id": key.key_id, "tenant_id": key.tenant_id, "revoked": key.revoked}

    def _file(self, name: str) -> Response:
        found = assets.asset(name)
        if found is None:
            raise NotFound(f"no console file {name[:64]!r}")
        return Response(found.body, media_type=found.content_type, headers=assets.HEADERS)

    async def _principal(self, request: Request) -> Principal:
        peer = request.client.host if request.client is not None else ""
        return await authenticate(
            self.gateway.db,
            [("authorization", request.headers.get("authorization", ""))],
            admin_token=self.settings.admin_token,
            allow_admin=True,
            peer=peer,
            failures=self.gateway.auth_failures,
            cache=self.gateway.key_cache,
        )

    async def _tenant(self, request: Request) -> Principal:
        """A tenant's key; the admin token is refused."""
        principal = await self._principal(request)
        if principal.tenant_id is None:
            raise PermissionDenied("the tenant view needs an API key, not the admin token")
        return principal

    async def _operator(self, request: Request) -> None:
        if not (await self._principal(request)).is_admin:
            raise PermissionDenied("the operator view needs the admin token")
