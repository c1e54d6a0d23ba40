"""FakeAdmin and FakeLedger answer as the real AdminServicer and LedgerServicer do.

Each contract class talks to its service through the stub only, with the admin token;
one subclass runs it against the fake, the other against the real servicer on
PostgreSQL. The ledger's figures are the fake's canned ones or, for the real one, those
of a run the real ledger billed: the contract is their shape, not their values.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.admission.tenant_store import DEFAULT_MAX_CONCURRENT_RUNS
from services.core.db import open_db
from services.core.event_store import EventStore
from services.core.pricing import PriceTable
from services.core.server import create_server
from services.ledger.servicer import LedgerServicer
from services.ledger.sweep import Sweeper
from tests.services.admission.running import ADMIN_TOKEN, auth, running_admission
from tests.services.ledger.runs import create_tenant, terminal_run
from tests.tollgate.contract import refusal
from tests.tollgate.fake_gateway import TENANT, start_fake
from tollgate.v1 import admin_pb2, admin_pb2_grpc, ledger_pb2, ledger_pb2_grpc

ADMIN = auth(ADMIN_TOKEN)


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


class AdminContractTests:
    """Subclasses provide an `admin` fixture: an AdminService stub that takes ADMIN."""

    async def test_a_tenant_reads_back_as_created(
        self, admin: admin_pb2_grpc.AdminServiceStub
    ) -> None:
        name = unique("acme")
        tenant = await admin.CreateTenant(admin_pb2.CreateTenantRequest(name=name), metadata=ADMIN)
        assert tenant.tenant_id and (tenant.name, tenant.weight) == (name, 1)  # 0: the default
        # New tenants run a bounded number of runs at once until a quota says otherwise.
        assert tenant.quota == admin_pb2.Quota(
            tenant_id=tenant.tenant_id, max_concurrent_runs=DEFAULT_MAX_CONCURRENT_RUNS
        )
        got = await admin.GetTenant(
            admin_pb2.GetTenantRequest(tenant_id=tenant.tenant_id), metadata=ADMIN
        )
        assert got == tenant
        listed = await admin.ListTenants(admin_pb2.ListTenantsRequest(), metadata=ADMIN)
        assert tenant in listed.tenants

    async def test_a_tenant_name_is_taken_once(
        self, admin: admin_pb2_grpc.AdminServiceStub
    ) -> None:
        request = admin_pb2.CreateTenantRequest(name=unique("twice"), weight=2)
        await admin.CreateTenant(request, metadata=ADMIN)
        code, _ = await refusal(admin.CreateTenant(request, metadata=ADMIN))
        assert code == grpc.StatusCode.FAILED_PRECONDITION

    async def test_bad_input_is_an_invalid_argument_naming_the_field(
        self, admin: admin_pb2_grpc.AdminServiceStub
    ) -> None:
        for request, field in (
            (admin_pb2.CreateTenantRequest(name="  "), "name"),
            (admin_pb2.CreateTenantRequest(name=unique("neg"), weight=-1), "weight"),
        ):
            call = admin.CreateTenant(request, metadata=ADMIN)
            assert await refusal(call) == (grpc.StatusCode.INVALID_ARGUMENT, [field])
        tenant = await admin.CreateTenant(
            admin_pb2.CreateTenantRequest(name=unique("quota")), metadata=ADMIN
        )
        quota = admin_pb2.Quota(tenant_id=tenant.tenant_id, max_kv_blocks=-1)
        call = admin.SetQuota(admin_pb2.SetQuotaRequest(quota=quota), metadata=ADMIN)
        assert await refusal(call) == (grpc.StatusCode.INVALID_ARGUMENT, ["quota.max_kv_blocks"])

    async def test_unknown_tenants_and_keys_are_not_found(
        self, admin: admin_pb2_grpc.AdminServiceStub
    ) -> None:
        for call in (
            admin.GetTenant(admin_pb2.GetTenantRequest(tenant_id="nope"), metadata=ADMIN),
            admin.CreateApiKey(admin_pb2.CreateApiKeyRequest(tenant_id="nope"), metadata=ADMIN),
            admin.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(key_id="nope"), metadata=ADMIN),
            admin.SetQuota(
                admin_pb2.SetQuotaRequest(quota=admin_pb2.Quota(tenant_id="nope")), metadata=ADMIN
            ),
        ):
            assert (await refusal(call))[0] == grpc.StatusCode.NOT_FOUND

    async def test_a_keys_secret_is_shown_once(
        self, admin: admin_pb2_grpc.AdminServiceStub
    ) -> None:
        tenant = await admin.CreateTenant(
            admin_pb2.CreateTenantRequest(name=unique("keys")), metadata=ADMIN
        )
        request = admin_pb2.CreateApiKeyRequest(tenant_id=tenant.tenant_id)
        first = await admin.CreateApiKey(request, metadata=ADMIN)
        second = await admin.CreateApiKey(request, metadata=ADMIN)
        assert first.key_id and first.secret and not first.revoked
        assert first.tenant_id == tenant.tenant_id
        assert (second.key_id, second.secret) != (first.key_id, first.secret)
        revoked = await admin.RevokeApiKey(
            admin_pb2.RevokeApiKeyRequest(key_id=first.key_id), metadata=ADMIN
        )
        assert (revoked.key_id, revoked.tenant_id) == (first.key_id, tenant.tenant_id)
        assert revoked.revoked and revoked.secret == ""

    async def test_keys_list_without_secrets_and_rotate_under_their_id(
        self, admin: admin_pb2_grpc.AdminServiceStub
    ) -> None:
        tenant = await admin.CreateTenant(
            admin_pb2.CreateTenantRequest(name=unique("scoped")), metadata=ADMIN
        )
        request = admin_pb2.CreateApiKeyRequest(
            tenant_id=tenant.tenant_id, alias="svc", allowed_models=["m"]
        )
        made = [await admin.CreateApiKey(request, metadata=ADMIN) for _ in range(2)]
        listed, token = [], ""
        while True:
            page = await admin.ListApiKeys(
                admin_pb2.ListApiKeysRequest(
                    tenant_id=tenant.tenant_id, page_size=1, page_token=token
                ),
                metadata=ADMIN,
            )
            listed += page.api_keys
            token = page.next_page_token
            if not token:
                break
        assert [k.key_id for k in listed] == [k.key_id for k in made]
        assert all(k.secret == "" and k.alias == "svc" for k in listed)
        assert all(list(k.allowed_models) == ["m"] for k in listed)
        rotated = await admin.RotateApiKey(
            admin_pb2.RotateApiKeyRequest(key_id=made[0].key_id), metadata=ADMIN
        )
        assert rotated.key_id == made[0].key_id and rotated.secret not in ("", made[0].secret)
        assert rotated.alias == "svc" and rotated.HasField("previous_secret_expire_time")

    async def test_a_quota_reads_back_as_set(self, admin: admin_pb2_grpc.AdminServiceStub) -> None:
        tenant = await admin.CreateTenant(
            admin_pb2.CreateTenantRequest(name=unique("quota")), metadata=ADMIN
        )
        quota = admin_pb2.Quota(tenant_id=tenant.tenant_id, max_kv_blocks=64)
        assert await admin.SetQuota(admin_pb2.SetQuotaRequest(quota=quota), metadata=ADMIN) == quota
        got = await admin.GetTenant(
            admin_pb2.GetTenantRequest(tenant_id=tenant.tenant_id), metadata=ADMIN
        )
        assert got.quota == quota


class TestFakeAdmin(AdminContractTests):
    @pytest.fixture
    async def admin(self) -> AsyncIterator[admin_pb2_grpc.AdminServiceStub]:
        fake = await start_fake()
        async with grpc.aio.insecure_channel(fake.address) as channel:
            yield admin_pb2_grpc.AdminServiceStub(channel)
        await fake.server.stop(0)


class TestAdminServicer(AdminContractTests):
    @pytest.fixture
    async def admin(
        self, database_url: str, kafka_bootstrap: str, kafka_topic: str, tiny_model_dir: Path
    ) -> AsyncIterator[admin_pb2_grpc.AdminServiceStub]:
        async with running_admission(
            database_url, kafka_bootstrap, kafka_topic, tiny_model_dir
        ) as admission:
            yield admission.admin


@dataclass
class LedgerSide:
    stub: ledger_pb2_grpc.LedgerServiceStub
    tenant_id: str  # a tenant with billed runs


class LedgerContractTests:
    """Subclasses provide a `ledger` fixture: a LedgerSide that takes ADMIN."""

    async def test_usage_adds_up_its_lines(self, ledger: LedgerSide) -> None:
        usage = await ledger.stub.GetUsage(
            ledger_pb2.GetUsageRequest(tenant_id=ledger.tenant_id), metadata=ADMIN
        )
        assert usage.tenant_id == ledger.tenant_id and usage.num_runs >= 1 and usage.currency
        assert usage.amount_micros == sum(line.amount_micros for line in usage.lines)
        assert all(line.billing_type and line.quantity >= 0 for line in usage.lines)

    async def test_entries_are_the_tenants_and_price_their_quantity(
        self, ledger: LedgerSide
    ) -> None:
        page = await ledger.stub.ListLedgerEntries(
            ledger_pb2.ListLedgerEntriesRequest(tenant_id=ledger.tenant_id), metadata=ADMIN
        )
        assert page.entries and page.next_page_token == ""
        for entry in page.entries:
            assert entry.entry_id and entry.run_id and entry.billing_type
            assert entry.tenant_id == ledger.tenant_id and entry.HasField("create_time")
            assert entry.amount_micros == entry.quantity * entry.unit_price_micros
        run_id = page.entries[0].run_id
        one_run = await ledger.stub.ListLedgerEntries(
            ledger_pb2.ListLedgerEntriesRequest(tenant_id=ledger.tenant_id, run_id=run_id),
            metadata=ADMIN,
        )
        assert one_run.entries and {e.run_id for e in one_run.entries} == {run_id}

    async def test_a_ledger_with_every_run_billed_reconciles(self, ledger: LedgerSide) -> None:
        report = await ledger.stub.GetReconciliation(
            ledger_pb2.GetReconciliationRequest(), metadata=ADMIN
        )
        assert report == ledger_pb2.Reconciliation(ok=True)


class TestFakeLedger(LedgerContractTests):
    @pytest.fixture
    async def ledger(self) -> AsyncIterator[LedgerSide]:
        fake = await start_fake()
        async with grpc.aio.insecure_channel(fake.address) as channel:
            yield LedgerSide(ledger_pb2_grpc.LedgerServiceStub(channel), TENANT)
        await fake.server.stop(0)


class TestLedgerServicer(LedgerContractTests):
    @pytest.fixture
    async def ledger(self, database_url: str) -> AsyncIterator[LedgerSide]:
        db = open_db(database_url)
        tenant_id, _ = await create_tenant(db)
        prices = PriceTable({"*": {"input_tokens": 2, "output_tokens": 8}})
        for _ in range(2):
            run_id = await terminal_run(EventStore(db), tenant_id)
            assert await Sweeper(db, prices, grace=0).bill_one(run_id) is not None
        servicer = LedgerServicer(
            db, admin_token=ADMIN_TOKEN, currency=prices.currency, sweep_grace=10
        )
        server, port, _ = create_server(
            "127.0.0.1:0",
            lambda s: ledger_pb2_grpc.add_LedgerServiceServicer_to_server(servicer, s),
        )
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield LedgerSide(ledger_pb2_grpc.LedgerServiceStub(channel), tenant_id)
        await server.stop(0)
        await db.dispose()
