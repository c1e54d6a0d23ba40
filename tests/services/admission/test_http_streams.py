"""The per-tenant stream limit on the HTTP front door: a 429 with OpenAI's error body and
a retry-after, like every other tenant limit."""

from __future__ import annotations

import httpx2
from google.protobuf import duration_pb2

from services.admission.http.app import create_app
from tests.services.admission.calls import request
from tests.services.admission.running import MODEL, Admission, auth
from tests.services.admission.test_isolation import set_stream_quota


async def test_a_stream_past_the_tenants_limit_is_a_429(admission: Admission) -> None:
    tenant_id, key = await admission.new_tenant_key("http-streamer")
    await set_stream_quota(admission, tenant_id, 1)
    held = admission.gateway.Generate(
        request(disconnect_grace=duration_pb2.Duration(seconds=60)), metadata=auth(key)
    )
    await held.read()
    transport = httpx2.ASGITransport(app=create_app(admission.core))
    async with httpx2.AsyncClient(transport=transport, base_url="http://admission") as http:
        for stream in (False, True):
            answer = await http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "one too many", "max_tokens": 4, "stream": stream},
                headers={"authorization": f"Bearer {key}"},
            )
            assert answer.status_code == 429, answer.text
            assert int(answer.headers["retry-after"]) >= 1
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "rate_limit_error"
            assert "stream" in error["message"]
    held.cancel()
