"""The `AdminService`: tenants, API keys and quotas, behind the admin token."""

from __future__ import annotations

import grpc

from services.admission.grpc.messages import (
    key_quota_to_proto,
    key_to_proto,
    limits_from_proto,
    overlap_from_proto,
    quota_violations,
    scopes_from_proto,
    tenant_to_proto,
)
from services.admission.key_store import KeyStore
from services.admission.tenant_store import DEFAULT_MAX_CONCURRENT_RUNS, TenantStore
from services.core.auth import require_admin
from services.core.db import Database
from services.core.errors import FieldViolation, InvalidArgument
from services.core.grpc_errors import rpc_errors
from services.core.key_cache import KeyCache
from services.core.ratelimit import FailedAttempts
from services.core.validation import text_violation
from tollgate.v1 import admin_pb2, admin_pb2_grpc

# Names are unique through an index, whose rows PostgreSQL keeps to under 2,700 bytes.
MAX_TENANT_NAME = 200
# A tenant's share of the fair queue against a weight-1 tenant's; past this, one tenant
# would be served almost alone.
MAX_TENANT_WEIGHT = 1000


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        db: Database,
        admin_token: str,
        default_max_concurrent_runs: int = DEFAULT_MAX_CONCURRENT_RUNS,
        *,
        key_cache: KeyCache | None,
        failures: FailedAttempts | None = None,
    ) -> None:
        """`failures` counts wrong admin tokens per peer: share the gateway's, so that a
        peer guessing at either front door is held back at both; `key_cache` is the
        gateway's, which forgets the keys changed here."""
        self.tenants = TenantStore(db, default_max_concurrent_runs)
        self.keys = KeyStore(db, key_cache)
        self.admin_token = admin_token
        self.failures = failures or FailedAttempts()

    def _require_admin(self, context: grpc.aio.ServicerContext) -> None:
        require_admin(
            context.invocation_metadata(),
            self.admin_token,
            peer=context.peer(),
            failures=self.failures,
        )

    @rpc_errors
    async def CreateTenant(
        self, request: admin_pb2.CreateTenantRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Tenant:
        self._require_admin(context)
        violations = []
        name = request.name.strip()
        if not name:
            violations.append(FieldViolation("name", "must not be empty"))
        elif (bad_name := text_violation("name", name, MAX_TENANT_NAME)) is not None:
            violations.append(bad_name)
        if not 0 <= request.weight <= MAX_TENANT_WEIGHT:
            violations.append(
                FieldViolation(
                    "weight", f"must be 1 to {MAX_TENANT_WEIGHT} (0 means the default, 1)"
                )
            )
        if violations:
            raise InvalidArgument(violations)
        return tenant_to_proto(await self.tenants.create(name, request.weight or 1))

    @rpc_errors
    async def GetTenant(
        self, request: admin_pb2.GetTenantRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Tenant:
        self._require_admin(context)
        return tenant_to_proto(await self.tenants.get(request.tenant_id))

    @rpc_errors
    async def ListTenants(
        self, request: admin_pb2.ListTenantsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListTenantsResponse:
        self._require_admin(context)
        return admin_pb2.ListTenantsResponse(
            tenants=[tenant_to_proto(t) for t in await self.tenants.list()]
        )

    @rpc_errors
    async def CreateApiKey(
        self, request: admin_pb2.CreateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ApiKey:
        self._require_admin(context)
        scopes = scopes_from_proto(request)
        return key_to_proto(await self.keys.create(request.tenant_id, scopes))

    @rpc_errors
    async def RevokeApiKey(
        self, request: admin_pb2.RevokeApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ApiKey:
        self._require_admin(context)
        return key_to_proto(await self.keys.revoke(request.key_id))

    @rpc_errors
    async def ListApiKeys(
        self, request: admin_pb2.ListApiKeysRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListApiKeysResponse:
        self._require_admin(context)
        keys, token = await self.keys.list(request.tenant_id, request.page_size, request.page_token)
        return admin_pb2.ListApiKeysResponse(
            api_keys=[key_to_proto(k) for k in keys], next_page_token=token
        )

    @rpc_errors
    async def RotateApiKey(
        self, request: admin_pb2.RotateApiKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ApiKey:
        self._require_admin(context)
        overlap = overlap_from_proto(request)
        return key_to_proto(await self.keys.rotate(request.key_id, overlap))

    @rpc_errors
    async def SetQuota(
        self, request: admin_pb2.SetQuotaRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Quota:
        self._require_admin(context)
        quota = request.quota
        violations = quota_violations(quota)
        if violations:
            raise InvalidArgument(violations)
        limits = limits_from_proto(quota)
        if quota.key_id:
            key_quota = await self.tenants.set_key_quota(quota.tenant_id, quota.key_id, limits)
            return key_quota_to_proto(key_quota)
        streams = quota.max_concurrent_streams if quota.HasField("max_concurrent_streams") else None
        tenant = await self.tenants.set_quota(
            quota.tenant_id, quota.max_kv_blocks, quota.max_concurrent_runs, streams, limits
        )
        return tenant_to_proto(tenant).quota
