import json
from typing import Any

import grpc
import pytest
import sqlalchemy as sa
from aiokafka import ConsumerRecord

from services.core.auth import hash_secret
from tests.services.admission.calls import secret_part
from tests.services.admission.running import ADMIN_TOKEN, Admission, auth
from tests.services.core.kafka_tools import read_topic
from tollgate.v1 import admin_pb2

ADMIN = auth(ADMIN_TOKEN)


def headers_of(record: ConsumerRecord) -> dict[str, str]:
    return {name: (value or b"").decode() for name, value in record.headers}


def of_type(records: list[ConsumerRecord], ce_type: str) -> list[ConsumerRecord]:
    return [r for r in records if headers_of(r)["ce_type"] == ce_type]


async def test_every_admin_change_is_one_cloudevent_with_before_and_after(
    admission: Admission, kafka_bootstrap: str
) -> None:
    tenant = await admission.admin.CreateTenant(
        admin_pb2.CreateTenantRequest(name="acme", weight=2), metadata=ADMIN
    )
    quota = admin_pb2.Quota(tenant_id=tenant.tenant_id, max_kv_blocks=64, max_concurrent_runs=3)
    await admission.admin.SetQuota(admin_pb2.SetQuotaRequest(quota=quota), metadata=ADMIN)
    key = await admission.admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant_id=tenant.tenant_id, alias="bot"), metadata=ADMIN
    )
    rotated = await admission.admin.RotateApiKey(
        admin_pb2.RotateApiKeyRequest(key_id=key.key_id), metadata=ADMIN
    )
    await admission.admin.RevokeApiKey(
        admin_pb2.RevokeApiKeyRequest(key_id=key.key_id), metadata=ADMIN
    )

    records = await read_topic(kafka_bootstrap, admission.admin_topic, min_records=5)
    [quota_set] = of_type(records, "tollgate.admin.quota.set.v1")
    headers = headers_of(quota_set)
    assert headers["ce_specversion"] == "1.0" and headers["ce_source"] == "//tollgate/admin"
    assert headers["ce_subject"] == tenant.tenant_id and headers["ce_id"].startswith("adm_")
    assert headers["content-type"] == "application/json" and headers["ce_time"].endswith("Z")
    assert quota_set.key == tenant.tenant_id.encode()
    data = json.loads(quota_set.value)
    assert data["actor"] == "admin"
    assert (data["before"]["max_kv_blocks"], data["after"]["max_kv_blocks"]) == (0, 64)
    assert data["before"]["max_concurrent_runs"] == 64 and data["after"]["max_concurrent_runs"] == 3
    assert data["after"]["name"] == "acme" and data["after"]["weight"] == 2

    [created] = of_type(records, "tollgate.admin.tenant.created.v1")
    assert json.loads(created.value)["before"] is None
    [key_created] = of_type(records, "tollgate.admin.api_key.created.v1")
    after = json.loads(key_created.value)["after"]
    assert after["key_id"] == key.key_id and after["alias"] == "bot"
    [revoked] = of_type(records, "tollgate.admin.api_key.revoked.v1")
    assert json.loads(revoked.value)["after"]["revoked"] is True
    assert len(of_type(records, "tollgate.admin.api_key.rotated.v1")) == 1
    # Per tenant, in the order the changes were made.
    assert [headers_of(r)["ce_type"].split(".")[2:4] for r in records] == [
        ["tenant", "created"],
        ["quota", "set"],
        ["api_key", "created"],
        ["api_key", "rotated"],
        ["api_key", "revoked"],
    ]
    published = b"".join(r.value for r in records)
    for secret in (key.secret, rotated.secret):
        tail = secret_part(secret)
        assert tail.encode() not in published and hash_secret(tail).encode() not in published


async def test_a_refused_change_records_no_event(admission: Admission) -> None:
    quota = admin_pb2.Quota(tenant_id="ten_missing", max_kv_blocks=1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admission.admin.SetQuota(admin_pb2.SetQuotaRequest(quota=quota), metadata=ADMIN)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert await num_admin_events(admission) == 0


async def num_admin_events(admission: Admission) -> Any:
    async with admission.db.connect() as conn:
        return await conn.scalar(sa.text("SELECT count(*) FROM admin_events"))
