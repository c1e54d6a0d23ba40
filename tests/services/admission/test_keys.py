import asyncio
import http.client
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import httpx2
import pytest
import sqlalchemy as sa
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from services.admission.http.app import create_app
from services.admission.http.server import HttpServer
from tests.services.admission.calls import first_event, request, secret_part
from tests.services.admission.running import (
    ADMIN_TOKEN,
    KEY_CHECK_INTERVAL,
    MODEL,
    Admission,
    auth,
)
from tollgate.v1 import admin_pb2, events_pb2, gateway_pb2

ADMIN = auth(ADMIN_TOKEN)


async def new_tenant(admission: Admission, name: str = "acme") -> str:
    tenant = await admission.admin.CreateTenant(
        admin_pb2.CreateTenantRequest(name=name), metadata=ADMIN
    )
    return tenant.tenant_id


async def _past(moment: datetime) -> None:
    await asyncio.sleep((moment - datetime.now(UTC)).total_seconds() + 0.05)


async def create_key(admission: Admission, tenant_id: str, **fields: Any) -> admin_pb2.ApiKey:
    request = admin_pb2.CreateApiKeyRequest(tenant_id=tenant_id, **fields)
    return await admission.admin.CreateApiKey(request, metadata=ADMIN)


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def list_runs_with(admission: Admission, secret: str) -> Any:
    return await admission.gateway.ListRuns(gateway_pb2.ListRunsRequest(), metadata=auth(secret))


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    raise AssertionError("no ErrorInfo")


async def test_a_key_runs_only_its_allowed_models(admission: Admission) -> None:
    tenant_id = await new_tenant(admission)
    key = await create_key(admission, tenant_id, allowed_models=[MODEL], alias="ci bot")
    assert list(key.allowed_models) == [MODEL] and key.alias == "ci bot"
    queued = await first_event(admission, key.secret, request())
    assert queued.WhichOneof("kind") == "queued"
    call = admission.gateway.Generate(request(model="other"), metadata=auth(key.secret))
    error = await refusal(call.read())
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "model" in (error.details() or "")
    info = error_info(error)
    assert info.reason == "MODEL_NOT_ALLOWED" and info.metadata["field"] == "model"
    unscoped = await create_key(admission, tenant_id)
    call = admission.gateway.Generate(request(model="other"), metadata=auth(unscoped.secret))
    error = await refusal(call.read())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # unknown model, not a scope


async def test_an_expired_key_is_unauthenticated_without_its_secret(admission: Admission) -> None:
    tenant_id = await new_tenant(admission)
    later = datetime.now(UTC) + timedelta(seconds=1.5)
    key = await create_key(admission, tenant_id, expire_time=_stamp(later))
    assert key.expire_time.ToDatetime(tzinfo=UTC) == later
    await list_runs_with(admission, key.secret)
    # Kept by the gateway's key cache since, though never past its expiry.
    await list_runs_with(admission, key.secret)
    await _past(later)
    error = await refusal(list_runs_with(admission, key.secret))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    details = error.details() or ""
    assert "expired" in details and key.key_id in details and key.secret not in details


async def test_a_key_cannot_be_born_expired_nor_with_a_bad_scope(admission: Admission) -> None:
    tenant_id = await new_tenant(admission)
    earlier = datetime.now(UTC) - timedelta(seconds=1)
    for fields, field in (
        ({"expire_time": _stamp(earlier)}, "expire_time"),
        ({"alias": "a\x07b"}, "alias"),
        ({"alias": "x" * 101}, "alias"),
        ({"allowed_models": [""]}, "allowed_models[0]"),
    ):
        error = await refusal(create_key(admission, tenant_id, **fields))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (error.details() or "")


async def test_list_pages_a_tenants_keys_without_secrets(admission: Admission) -> None:
    tenant_id, other_id = await new_tenant(admission), await new_tenant(admission, "other")
    made = [await create_key(admission, tenant_id, alias=f"k{n}") for n in range(3)]
    await create_key(admission, other_id)
    listing = admin_pb2.ListApiKeysRequest(tenant_id=tenant_id, page_size=2)
    first = await admission.admin.ListApiKeys(listing, metadata=ADMIN)
    assert len(first.api_keys) == 2 and first.next_page_token
    listing.page_token = first.next_page_token
    second = await admission.admin.ListApiKeys(listing, metadata=ADMIN)
    assert second.next_page_token == ""
    listed = [*first.api_keys, *second.api_keys]
    assert [k.key_id for k in listed] == [k.key_id for k in made]
    assert [k.alias for k in listed] == ["k0", "k1", "k2"]
    assert all(k.secret == "" and k.HasField("create_time") for k in listed)
    for key in made:
        assert secret_part(key.secret) not in str(listed)
    listing.tenant_id = other_id
    error = await refusal(admission.admin.ListApiKeys(listing, metadata=ADMIN))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in (
        error.details() or ""
    )


async def test_rotation_keeps_the_old_secret_for_the_overlap_only(admission: Admission) -> None:
    tenant_id = await new_tenant(admission)
    key = await create_key(admission, tenant_id, allowed_models=[MODEL], alias="svc")
    overlap = duration_pb2.Duration(nanos=600_000_000)
    rotated = await admission.admin.RotateApiKey(
        admin_pb2.RotateApiKeyRequest(key_id=key.key_id, overlap=overlap), metadata=ADMIN
    )
    assert rotated.key_id == key.key_id and rotated.secret not in ("", key.secret)
    assert list(rotated.allowed_models) == [MODEL] and rotated.alias == "svc"
    assert rotated.HasField("previous_secret_expire_time")
    await list_runs_with(admission, rotated.secret)
    await list_runs_with(admission, key.secret)  # within the overlap
    await asyncio.sleep(0.8)
    error = await refusal(list_runs_with(admission, key.secret))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    await list_runs_with(admission, rotated.secret)
    at_once = await admission.admin.RotateApiKey(
        admin_pb2.RotateApiKeyRequest(key_id=key.key_id, overlap=duration_pb2.Duration()),
        metadata=ADMIN,
    )
    error = await refusal(list_runs_with(admission, rotated.secret))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    await list_runs_with(admission, at_once.secret)


async def test_rotation_refuses_a_revoked_key_and_an_unbounded_overlap(
    admission: Admission,
) -> None:
    tenant_id = await new_tenant(admission)
    key = await create_key(admission, tenant_id)
    week_and_a_bit = duration_pb2.Duration(seconds=7 * 86400 + 1)
    error = await refusal(
        admission.admin.RotateApiKey(
            admin_pb2.RotateApiKeyRequest(key_id=key.key_id, overlap=week_and_a_bit),
            metadata=ADMIN,
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "overlap" in (error.details() or "")
    await admission.admin.RevokeApiKey(
        admin_pb2.RevokeApiKeyRequest(key_id=key.key_id), metadata=ADMIN
    )
    error = await refusal(
        admission.admin.RotateApiKey(
            admin_pb2.RotateApiKeyRequest(key_id=key.key_id), metadata=ADMIN
        )
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    error = await refusal(
        admission.admin.RotateApiKey(admin_pb2.RotateApiKeyRequest(key_id="nope"), metadata=ADMIN)
    )
    assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_the_http_api_answers_403_for_a_model_and_401_for_an_expired_key(
    admission: Admission,
) -> None:
    tenant_id = await new_tenant(admission)
    later = datetime.now(UTC) + timedelta(seconds=2)
    key = await create_key(
        admission, tenant_id, allowed_models=["someone-elses"], expire_time=_stamp(later)
    )
    server = HttpServer(create_app(admission.core), "127.0.0.1:0")
    task = asyncio.create_task(server.run())
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        status, answer = await asyncio.to_thread(_post, server.url, key.secret, body)
        assert status == 403 and answer["error"]["param"] == "model"
        status, models = await asyncio.to_thread(_get, server.url, key.secret, "/v1/models")
        assert status == 200 and models["data"] == []
        status, _ = await asyncio.to_thread(_get, server.url, key.secret, f"/v1/models/{MODEL}")
        assert status == 404
        listed = await admission.gateway.ListModels(
            gateway_pb2.ListModelsRequest(), metadata=auth(key.secret)
        )
        assert list(listed.models) == []
        await _past(later)
        status, answer = await asyncio.to_thread(_post, server.url, key.secret, body)
        assert status == 401 and "expired" in answer["error"]["message"]
        assert key.secret not in json.dumps(answer)
    finally:
        await server.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _stamp(moment: datetime) -> Any:
    from google.protobuf import timestamp_pb2

    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment)
    return stamp


def _post(url: str, key: str, body: dict[str, Any]) -> tuple[int, Any]:
    return _call(url, key, "POST", "/v1/chat/completions", json.dumps(body))


def _get(url: str, key: str, path: str) -> tuple[int, Any]:
    return _call(url, key, "GET", path, None)


def _call(url: str, key: str, method: str, path: str, body: str | None) -> tuple[int, Any]:
    host = url.removeprefix("http://")
    conn = http.client.HTTPConnection(host, timeout=30)
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


async def test_a_key_sees_only_the_runs_of_models_it_may_run(admission: Admission) -> None:
    tenant_id = await new_tenant(admission, "scoped-reads")
    everything = await create_key(admission, tenant_id)
    elsewhere = await create_key(admission, tenant_id, allowed_models=["another-model"])
    run_id = (await first_event(admission, everything.secret, request())).run_id
    hidden = auth(elsewhere.secret)
    for call in (
        admission.gateway.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=hidden),
        admission.gateway.CancelRun(gateway_pb2.CancelRunRequest(run_id=run_id), metadata=hidden),
        admission.gateway.StreamRun(
            gateway_pb2.StreamRunRequest(run_id=run_id), metadata=hidden
        ).read(),
    ):
        assert (await refusal(call)).code() == grpc.StatusCode.NOT_FOUND
    assert [r.run_id for r in (await list_runs_with(admission, elsewhere.secret)).runs] == []
    assert [r.run_id for r in (await list_runs_with(admission, everything.secret)).runs] == [run_id]
    transport = httpx2.ASGITransport(app=create_app(admission.core))
    async with httpx2.AsyncClient(transport=transport, base_url="http://admission") as http:
        for method, path in (
            ("GET", f"/v1/runs/{run_id}"),
            ("POST", f"/v1/runs/{run_id}/cancel"),
            ("GET", f"/v1/runs/{run_id}/events"),
        ):
            answer = await http.request(
                method, path, headers={"authorization": f"Bearer {elsewhere.secret}"}
            )
            assert answer.status_code == 404, (method, path)
    run = await admission.gateway.GetRun(
        gateway_pb2.GetRunRequest(run_id=run_id), metadata=auth(everything.secret)
    )
    assert run.state != events_pb2.RUN_STATE_CANCELLED


async def test_the_streams_of_a_revoked_or_rotated_key_end_and_others_go_on(
    admission: Admission,
) -> None:
    tenant_id = await new_tenant(admission, "revoked-streams")
    revoked, rotated, kept = [await create_key(admission, tenant_id) for _ in range(3)]
    streams = {}
    for key in (revoked, rotated, kept):
        call = admission.gateway.Generate(request(), metadata=auth(key.secret))
        assert (await call.read()).WhichOneof("kind") == "queued"  # then quiet: no worker
        streams[key.key_id] = call
    await admission.admin.RevokeApiKey(
        admin_pb2.RevokeApiKeyRequest(key_id=revoked.key_id), metadata=ADMIN
    )
    await admission.admin.RotateApiKey(
        admin_pb2.RotateApiKeyRequest(key_id=rotated.key_id, overlap=duration_pb2.Duration()),
        metadata=ADMIN,
    )
    for key in (revoked, rotated):
        async with asyncio.timeout(10 * KEY_CHECK_INTERVAL + 5):
            error = await refusal(streams[key.key_id].read())
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert key.key_id in (error.details() or "")
    # The stream of a key still good goes on, and its run was never cancelled by it.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(5 * KEY_CHECK_INTERVAL):
            await streams[kept.key_id].read()
    streams[kept.key_id].cancel()


async def test_an_sse_stream_of_a_revoked_key_ends_with_an_error_event(
    admission: Admission,
) -> None:
    tenant_id = await new_tenant(admission, "revoked-sse")
    key = await create_key(admission, tenant_id)
    run_id = (await first_event(admission, key.secret, request())).run_id
    server = HttpServer(create_app(admission.core), "127.0.0.1:0")
    task = asyncio.create_task(server.run())
    headers = {"authorization": f"Bearer {key.secret}"}
    try:
        async with (
            httpx2.AsyncClient(base_url=server.url, timeout=30) as http,
            http.stream("GET", f"/v1/runs/{run_id}/events", headers=headers) as answer,
        ):
            assert answer.status_code == 200
            lines = answer.aiter_lines()
            while not (line := await anext(lines)).startswith("data:"):
                pass
            assert json.loads(line.removeprefix("data:"))["seq"] == 1
            await admission.admin.RevokeApiKey(
                admin_pb2.RevokeApiKeyRequest(key_id=key.key_id), metadata=ADMIN
            )
            async with asyncio.timeout(10 * KEY_CHECK_INTERVAL + 5):
                rest = [line async for line in lines if line.startswith("data:")]
        [last] = rest
        error = json.loads(last.removeprefix("data:"))["error"]
        assert error["type"] == "authentication_error" and key.key_id in error["message"]
    finally:
        await server.stop()
        await task


async def test_a_key_revoked_through_another_replica_stops_working_within_the_cache_seconds(
    admission: Admission,
) -> None:
    tenant_id = await new_tenant(admission)
    key = await create_key(admission, tenant_id)
    admission.core.key_cache.seconds = 0.5
    await list_runs_with(admission, key.secret)  # looked up, and kept
    async with admission.db.begin() as conn:  # as another replica's RevokeApiKey does
        await conn.execute(
            sa.text("UPDATE api_keys SET revoked_at = now() WHERE key_id = :key_id"),
            {"key_id": key.key_id},
        )
    await list_runs_with(admission, key.secret)  # this replica has not asked again yet
    await asyncio.sleep(0.6)
    error = await refusal(list_runs_with(admission, key.secret))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
