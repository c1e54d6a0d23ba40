import grpc
import pytest

from tests.services.admission.running import ADMIN_TOKEN, Admission, auth
from tollgate.v1 import admin_pb2, gateway_pb2


async def test_admin_creates_tenants_and_keys_that_work_once_shown(admission: Admission) -> None:
    admin = auth(ADMIN_TOKEN)
    tenant = await admission.admin.CreateTenant(
        admin_pb2.CreateTenantRequest(name="acme", weight=2), metadata=admin
    )
    assert tenant.weight == 2
    key = await admission.admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant_id=tenant.tenant_id), metadata=admin
    )
    assert key.secret.startswith("tg_")
    listed = await admission.gateway.ListRuns(
        gateway_pb2.ListRunsRequest(), metadata=auth(key.secret)
    )
    assert list(listed.runs) == []
    revoked = await admission.admin.RevokeApiKey(
        admin_pb2.RevokeApiKeyRequest(key_id=key.key_id), metadata=admin
    )
    assert revoked.revoked and revoked.secret == ""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admission.gateway.ListRuns(gateway_pb2.ListRunsRequest(), metadata=auth(key.secret))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_admin_api_needs_the_admin_token(admission: Admission) -> None:
    _, tenant_key = await admission.new_tenant_key("acme")
    for metadata in ((), auth("wrong"), auth(tenant_key)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admission.admin.ListTenants(admin_pb2.ListTenantsRequest(), metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_admin_validates_fields(admission: Admission) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admission.admin.CreateTenant(
            admin_pb2.CreateTenantRequest(name=" "), metadata=auth(ADMIN_TOKEN)
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "name" in (caught.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admission.admin.GetTenant(
            admin_pb2.GetTenantRequest(tenant_id="ten_x"), metadata=auth(ADMIN_TOKEN)
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
