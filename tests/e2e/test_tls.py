"""The public ports over TLS, with a certificate the test makes: the SDK's clients with
`root_certificates`, the CLI with `--tls-ca`, the OpenAI SDK checking the certificate; and
a plaintext client refused."""

from __future__ import annotations

import asyncio
import http.client
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import openai
import pytest

from services.stack.infra import Endpoints
from tests.certificates import Certificate, self_signed
from tests.e2e.conftest import Stack, running_stack
from tollgate import AsyncClient, Client
from tollgate.errors import TollgateError

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"


@pytest.fixture(scope="module")
def certificate() -> Iterator[Certificate]:
    with tempfile.TemporaryDirectory(prefix="tollgate-tls-") as scratch:
        yield self_signed(Path(scratch))


@pytest.fixture(scope="module")
def stack(
    infra: Endpoints, template_database: str, tiny_model_dir: Path, certificate: Certificate
) -> Iterator[Stack]:
    tls = (certificate.cert_path, certificate.key_path)
    with running_stack(infra, template_database, tiny_model_dir, tls=tls) as (stack, _):
        yield stack


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.tenant_key("tls")


def test_the_sdk_generates_over_tls(stack: Stack, key: str, certificate: Certificate) -> None:
    # Roots as bytes, or as a file's path; the ledger's port speaks TLS too.
    for roots in (certificate.pem, str(certificate.cert_path)):
        with Client(stack.gateway, key, ledger_address=stack.ledger, root_certificates=roots) as c:
            events = list(c.generate("secure hello", model=MODEL, max_tokens=4))
            assert [e.kind for e in events][-2:] == ["completed", "billed"]
            assert c.get_usage().num_runs >= 1


def test_the_asyncio_client_generates_over_tls(
    stack: Stack, key: str, certificate: Certificate
) -> None:
    async def generate() -> list[str]:
        async with AsyncClient(stack.gateway, key, root_certificates=certificate.cert_path) as c:
            return [e.kind async for e in c.generate("async hello", model=MODEL, max_tokens=4)]

    assert asyncio.run(generate())[-2:] == ["completed", "billed"]


def test_a_plaintext_or_untrusting_client_is_refused(
    stack: Stack, key: str, tmp_path: Path
) -> None:
    stranger = self_signed(tmp_path, "stranger")
    for client in (
        Client(stack.gateway, key, timeout=5),
        Client(stack.ledger, key, timeout=5),
        Client(stack.gateway, key, timeout=5, root_certificates=stranger.pem),
    ):
        with client, pytest.raises(TollgateError):
            client.list_runs()


def test_the_http_api_is_https(stack: Stack, key: str, certificate: Certificate) -> None:
    assert stack.http.startswith("https://")
    with httpx2.Client(verify=str(certificate.cert_path)) as checked:
        sdk = openai.OpenAI(
            base_url=f"{stack.http}/v1", api_key=key, max_retries=0, http_client=checked
        )
        reply = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert reply.choices[0].finish_reason in ("stop", "length")
    # A client that does not trust the certificate, or speaks plaintext, gets nothing.
    with httpx2.Client() as unchecked:
        untrusting = openai.OpenAI(
            base_url=f"{stack.http}/v1", api_key=key, max_retries=0, http_client=unchecked
        )
        with pytest.raises(openai.APIConnectionError):
            untrusting.models.list()
    plain = http.client.HTTPConnection(urlsplit(stack.http).netloc, timeout=10)
    with pytest.raises((http.client.HTTPException, OSError)):
        plain.request("GET", "/v1/models", headers={"authorization": f"Bearer {key}"})
        plain.getresponse()
    plain.close()


def test_the_cli_connects_with_tls_ca(stack: Stack, key: str, certificate: Certificate) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    command = [sys.executable, "-m", "tollgate.cli", "generate", "hello", "--model", MODEL]
    command += ["--max-tokens", "4", "--gateway", stack.gateway, "--api-key", key]
    command += ["--stack", "/nonexistent/stack.json"]
    for extra, variables in (
        (["--tls-ca", str(certificate.cert_path)], {}),
        ([], {"TOLLGATE_TLS_CA": str(certificate.cert_path)}),
    ):
        done = subprocess.run(
            [*command, *extra],
            env={**env, **variables},
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    refused = subprocess.run(
        command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0
