"""The tenant's side of the console's JSON: sign-in, runs, usage per day; and the page."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from services.core.pricing import PriceTable
from services.ledger.billing import bill_run
from tests.services.admission.running import ADMIN_TOKEN, auth
from tests.services.console.conftest import ConsoleServer
from tests.services.ledger.runs import queued_run, terminal_run, usage
from tollgate.v1 import admin_pb2

PRICES = PriceTable({"*": {"input_tokens": 2, "cached_input_tokens": 1, "output_tokens": 8}})


async def billed_run(console: ConsoleServer, tenant_id: str, output: int = 5) -> str:
    admission = console.admission
    run_id = await terminal_run(admission.store, tenant_id, run_usage=usage(10, 4, output))
    async with admission.db.begin() as conn:
        await bill_run(conn, run_id, PRICES)
    return run_id


async def test_the_page_is_served_with_a_policy_that_keeps_to_its_own_files(
    console: ConsoleServer,
) -> None:
    page = await console.call("/console")
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert page.headers["referrer-policy"] == "no-referrer"
    script = await console.call("/console/static/app.js")
    assert script.status == 200 and script.headers["content-type"].startswith("text/javascript")
    assert (await console.call("/console/")).status == 200  # redirected to /console
    missing = await console.call("/console/static/routes.py")
    assert missing.status == 404 and missing.json()["error"]["type"] == "not_found_error"


async def test_a_key_signs_in_as_its_tenant_and_the_admin_token_as_operator(
    console: ConsoleServer,
) -> None:
    tenant_id, key = await console.admission.new_tenant_key("console-session")
    tenant = await console.json("/console/api/session", key)
    assert tenant["role"] == "tenant" and tenant["tenant_id"] == tenant_id
    assert tenant["tenant_name"] == "console-session" and tenant["currency"] == "USD"
    assert (await console.json("/console/api/session", ADMIN_TOKEN))["role"] == "operator"
    for secret in (None, "tg_0000000000000000_notakeyatallnotakeyatall", ADMIN_TOKEN + "x"):
        refused = await console.call("/console/api/session", secret)
        assert refused.status == 401, secret
        assert refused.json()["error"]["type"] == "authentication_error"


async def test_runs_are_the_tenants_own_newest_first_with_their_state(
    console: ConsoleServer,
) -> None:
    tenant_id, key = await console.admission.new_tenant_key("console-runs")
    other_id, _ = await console.admission.new_tenant_key("console-runs-other")
    older = await billed_run(console, tenant_id)
    newer = await queued_run(console.admission.store, tenant_id)
    await queued_run(console.admission.store, other_id)
    answer = await console.json("/console/api/runs", key)
    assert [r["run_id"] for r in answer["runs"]] == [newer, older]
    assert [r["state"] for r in answer["runs"]] == ["RUN_STATE_QUEUED", "RUN_STATE_BILLED"]
    assert answer["runs"][1]["usage"]["output_tokens"] == 5
    first = await console.json("/console/api/runs?page_size=1", key)
    assert [r["run_id"] for r in first["runs"]] == [newer] and first["next_page_token"]
    rest = await console.json(f"/console/api/runs?page_token={first['next_page_token']}", key)
    assert [r["run_id"] for r in rest["runs"]] == [older] and not rest["next_page_token"]


async def test_a_model_scoped_key_lists_only_its_models_runs(console: ConsoleServer) -> None:
    tenant_id, _ = await console.admission.new_tenant_key("console-scoped")
    request = admin_pb2.CreateApiKeyRequest(tenant_id=tenant_id, allowed_models=["other"])
    scoped = await console.admission.admin.CreateApiKey(request, metadata=auth(ADMIN_TOKEN))
    await queued_run(console.admission.store, tenant_id, model="tiny")
    mine = await queued_run(console.admission.store, tenant_id, model="other")
    answer = await console.json("/console/api/runs", scoped.secret)
    assert [r["run_id"] for r in answer["runs"]] == [mine]


@pytest.mark.parametrize(
    ("query", "param"),
    [("page_token=nonsense", "page_token"), ("page_size=-1", "page_size")],
)
async def test_bad_paging_names_the_parameter(
    console: ConsoleServer, query: str, param: str
) -> None:
    _, key = await console.admission.new_tenant_key(f"console-paging-{param}")
    refused = await console.call(f"/console/api/runs?{query}", key)
    assert refused.status == 400
    assert refused.json()["error"]["param"] == param


async def test_the_admin_token_has_no_runs_of_its_own(console: ConsoleServer) -> None:
    refused = await console.call("/console/api/runs", ADMIN_TOKEN)
    assert refused.status == 403 and "API key" in refused.json()["error"]["message"]


async def test_usage_per_day_is_the_ledgers_for_the_tenant_and_all_for_the_operator(
    console: ConsoleServer,
) -> None:
    tenant_id, key = await console.admission.new_tenant_key("console-usage")
    other_id, other_key = await console.admission.new_tenant_key("console-usage-other")
    before = await console.json("/console/api/usage?days=3", key)
    assert [d["num_runs"] for d in before["days"]] == [0, 0, 0]
    await billed_run(console, tenant_id, output=5)
    await billed_run(console, other_id, output=7)
    mine = await console.json("/console/api/usage?days=3", key)
    today = mine["days"][-1]
    assert today["day"] == datetime.now(UTC).date().isoformat()
    assert today["num_runs"] == 1
    # Billed as 6 uncached input tokens and 4 cached ones.
    assert today["quantities"] == {
        "input_tokens": 6,
        "cached_input_tokens": 4,
        "output_tokens": 5,
    }
    # 6 uncached input tokens at 2, 4 cached at 1, 5 output at 8.
    assert today["amount_micros"] == 6 * 2 + 4 * 1 + 5 * 8
    everyone = await console.json("/console/api/usage?days=1", ADMIN_TOKEN)
    assert everyone["days"][0]["quantities"]["output_tokens"] == 12
    one = await console.json(f"/console/api/usage?days=1&tenant_id={other_id}", ADMIN_TOKEN)
    assert one["days"][0]["quantities"]["output_tokens"] == 7
    refused = await console.call(f"/console/api/usage?tenant_id={tenant_id}", other_key)
    assert refused.status == 403
    too_many = await console.call("/console/api/usage?days=0", key)
    assert too_many.status == 400 and too_many.json()["error"]["param"] == "days"
