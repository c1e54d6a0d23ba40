"""Every field of admission's requests is bounded: what is out of bounds is refused by name,
or names nothing, and stores nothing."""

import base64
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from engine.loader import load_model_config
from engine.tokenizer import Tokenizer
from services.admission.cancel import Canceller
from services.admission.catalog import ModelCatalog, ModelEntry
from services.admission.gateway import Gateway, GatewayConfig
from services.admission.requests import GenerateParams, Limits, Sampling
from services.admission.stream import RunFeed
from services.core.errors import InvalidArgument
from tests.services.admission.calls import count_runs, first_event, request, violations
from tests.services.admission.running import ADMIN_TOKEN, MODEL, Admission, auth
from tollgate.v1 import admin_pb2, events_pb2, gateway_pb2

NUL = "a\x00b"


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def generate_refused(
    admission: Admission, key: str, message: events_pb2.GenerateRequest, field: str
) -> None:
    error = await refused(first_event(admission, key, message))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert field in violations(error)
    assert await count_runs(admission) == 0


def with_stop_token_ids(ids: list[int]) -> events_pb2.GenerateRequest:
    message = request()
    message.sampling.stop_token_ids.extend(ids)
    return message


def chat(messages: list[tuple[str, str]]) -> events_pb2.GenerateRequest:
    return events_pb2.GenerateRequest(
        model=MODEL,
        messages=[events_pb2.ChatMessage(role=r, content=c) for r, c in messages],
        sampling=events_pb2.SamplingParams(max_tokens=4),
    )


async def test_stop_token_ids_are_few_and_in_the_vocabulary(
    admission: Admission, tiny_model_dir: Path
) -> None:
    _, key = await admission.new_tenant_key("acme")
    vocab_size = load_model_config(tiny_model_dir).vocab_size
    field = "sampling.stop_token_ids"
    # 220,000 ids: under the gRPC message limit, over the broker's once stored.
    for ids in ([1] * 65, [1] * 220_000, [vocab_size], [2**31 - 1]):
        await generate_refused(admission, key, with_stop_token_ids(ids), field)
    queued = await first_event(admission, key, with_stop_token_ids([vocab_size - 1] * 64))
    assert list(queued.queued.sampling.stop_token_ids) == [vocab_size - 1] * 64


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"sampling_temperature": float("inf")}, "sampling.temperature"),
        ({"sampling_top_p": float("inf")}, "sampling.top_p"),
        ({"sampling_top_p": float("nan")}, "sampling.top_p"),
        ({"idempotency_key": NUL}, "idempotency_key"),
        ({"idempotency_key": "k" * 257}, "idempotency_key"),
        ({"disconnect_grace": duration_pb2.Duration(seconds=10**15)}, "disconnect_grace"),
        (
            {"disconnect_grace": duration_pb2.Duration(seconds=10_000 * 365 * 86400)},
            "disconnect_grace",
        ),
        ({"disconnect_grace": duration_pb2.Duration(seconds=3601)}, "disconnect_grace"),
        ({"disconnect_grace": duration_pb2.Duration(seconds=-1)}, "disconnect_grace"),
        ({"disconnect_grace": duration_pb2.Duration(seconds=1, nanos=-5)}, "disconnect_grace"),
        ({"model": "m" * 20_000}, "model"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, str) else None,
)
async def test_out_of_bounds_values_are_refused_by_name(
    admission: Admission, overrides: dict[str, object], field: str
) -> None:
    _, key = await admission.new_tenant_key("acme")
    await generate_refused(admission, key, request(**overrides), field)


async def test_a_tiny_temperature_is_admitted_and_an_hour_of_grace_is_the_most(
    admission: Admission,
) -> None:
    _, key = await admission.new_tenant_key("acme")
    grace = duration_pb2.Duration(seconds=3600)
    queued = await first_event(
        admission, key, request(sampling_temperature=1e-30, disconnect_grace=grace)
    )
    assert queued.WhichOneof("kind") == "queued"


async def test_messages_are_bounded_in_number_and_in_characters_all_told(
    admission: Admission,
) -> None:
    _, key = await admission.new_tenant_key("acme")
    # Each message within the 2,000-character limit, 300,000 characters in all.
    await generate_refused(admission, key, chat([("user", "y" * 1500)] * 200), "messages")
    await generate_refused(admission, key, chat([("user", "y")] * 257), "messages")
    # 256 bad roles: the status names the first few, and still fits a client's trailers.
    error = await refused(first_event(admission, key, chat([("robot", "hi")] * 256)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 0 < len(violations(error)) <= 10 and len(error.details() or "") <= 1024


async def test_nul_in_prompt_messages_and_stop_strings_is_stored_safely(
    admission: Admission,
) -> None:
    _, key = await admission.new_tenant_key("acme")
    for message in (request(prompt=NUL), chat([("user", NUL)])):
        message.sampling.stop.append(NUL)
        queued = await first_event(admission, key, message)
        [stored] = await admission.store.read(queued.run_id, limit=1)
        assert stored.payload["sampling"]["stop"] == [NUL]
    assert await count_runs(admission) == 2


async def test_malformed_run_ids_name_nothing_in_a_short_message(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    for run_id in (NUL, "r" * 20_000, "run_é"):
        for call in (
            admission.gateway.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=auth(key)),
            admission.gateway.CancelRun(
                gateway_pb2.CancelRunRequest(run_id=run_id), metadata=auth(key)
            ),
            first_event(admission, key, gateway_pb2.StreamRunRequest(run_id=run_id)),
        ):
            error = await refused(call)
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert len(error.details() or "") < 200


async def test_starting_after_past_the_store_range_is_refused(admission: Admission) -> None:
    _, key = await admission.new_tenant_key("acme")
    queued = await first_event(
        admission, key, request(disconnect_grace=duration_pb2.Duration(seconds=60))
    )
    message = gateway_pb2.StreamRunRequest(run_id=queued.run_id, starting_after=2**63)
    error = await refused(first_event(admission, key, message))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "starting_after" in (error.details() or "")


@pytest.mark.parametrize(
    "token",
    [
        base64.urlsafe_b64encode(b"2024-01-01T00:00:00+00:00|run_\x00").decode(),
        base64.urlsafe_b64encode(b"2024-01-01T00:00:00|run_1").decode(),
        "A" * 100_000,
    ],
    ids=["nul-run-id", "naive-time", "huge"],
)
async def test_a_forged_page_token_is_refused(admission: Admission, token: str) -> None:
    _, key = await admission.new_tenant_key("acme")
    error = await refused(
        admission.gateway.ListRuns(
            gateway_pb2.ListRunsRequest(page_token=token), metadata=auth(key)
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(error) == ["page_token"]


@pytest.mark.parametrize("name", ["n" * 4000, NUL, "tab\tname", "n" * 201])
async def test_tenant_names_are_short_printable_text(admission: Admission, name: str) -> None:
    error = await refused(
        admission.admin.CreateTenant(
            admin_pb2.CreateTenantRequest(name=name), metadata=auth(ADMIN_TOKEN)
        )
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(error) == ["name"]
    assert await admission.tenants.list() == []


async def test_admin_ids_that_are_not_ids_name_nothing(admission: Admission) -> None:
    admin = auth(ADMIN_TOKEN)
    for bad in (NUL, "t" * 20_000):
        for call in (
            admission.admin.GetTenant(admin_pb2.GetTenantRequest(tenant_id=bad), metadata=admin),
            admission.admin.CreateApiKey(
                admin_pb2.CreateApiKeyRequest(tenant_id=bad), metadata=admin
            ),
            admission.admin.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(key_id=bad), metadata=admin),
            admission.admin.SetQuota(
                admin_pb2.SetQuotaRequest(quota=admin_pb2.Quota(tenant_id=bad)), metadata=admin
            ),
        ):
            error = await refused(call)
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert len(error.details() or "") < 200


def gateway_with(admission: Admission, entry: ModelEntry, limits: Limits) -> Gateway:
    return Gateway(
        admission.db,
        ModelCatalog({MODEL: entry}),
        RunFeed(admission.store.db.url.render_as_string(hide_password=False)),
        Canceller(admission.store, None),
        GatewayConfig(limits=limits),
    )


def tiny_entry(model_dir: Path, chat_template: str | None) -> ModelEntry:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    tokenizer.chat_template = chat_template
    return ModelEntry(MODEL, tokenizer, context_length=8192, vocab_size=512)


def params(prompt: str = "", messages: tuple[tuple[str, str], ...] = ()) -> GenerateParams:
    return GenerateParams(MODEL, prompt, messages, Sampling(max_tokens=4), "interactive", "", 0)


@pytest.mark.parametrize("template", [None, "{{ raise_exception('no user turns here') }}"])
async def test_a_model_that_cannot_template_the_messages_refuses_them(
    admission: Admission, tiny_model_dir: Path, template: str | None
) -> None:
    tenant_id, _ = await admission.new_tenant_key("acme")
    gateway = gateway_with(admission, tiny_entry(tiny_model_dir, template), Limits())
    with pytest.raises(InvalidArgument) as caught:
        await gateway.start(tenant_id, params(messages=(("user", "hi"),)))
    assert [v.field for v in caught.value.violations] == ["messages"]
    assert await count_runs(admission) == 0


async def test_a_queued_event_too_large_to_publish_is_refused(
    admission: Admission, tiny_model_dir: Path
) -> None:
    tenant_id, _ = await admission.new_tenant_key("acme")
    entry = ModelCatalog.load({MODEL: str(tiny_model_dir)}).get(MODEL)
    gateway = gateway_with(admission, entry, Limits(max_event_bytes=200))
    prompt = " ".join(f"w{i}" for i in range(300))
    with pytest.raises(InvalidArgument) as caught:
        await gateway.start(tenant_id, params(prompt))
    assert [v.field for v in caught.value.violations] == ["prompt"]
    assert await count_runs(admission) == 0
    await gateway.start(tenant_id, params("short"))
    assert await count_runs(admission) == 1
