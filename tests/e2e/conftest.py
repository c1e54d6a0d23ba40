"""The four services as real processes, started as `tollgate up` starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.core.kafka import ensure_topics
from services.stack.infra import (
    Endpoints,
    create_database_from_template,
    drop_database,
)
from services.stack.launcher import Services, StackConfig
from tollgate import AdminClient, Client
from tollgate.types import RunEvent

ADMIN_TOKEN = "e2e-admin-token-0123456789"
INTERNAL_TOKEN = "e2e-internal-token"
INTERNAL = (("authorization", f"Bearer {INTERNAL_TOKEN}"),)
NUM_KV_BLOCKS = 160


@dataclass
class Stack:
    gateway: str
    http: str
    ledger: str
    worker: str
    database_url: str
    admin: AdminClient
    metrics: dict[str, int]
    log_dir: Path

    def tenant_key(self, name: str) -> str:
        tenant = self.admin.create_tenant(f"{name}-{uuid.uuid4().hex[:6]}")
        return self.admin.create_api_key(tenant.tenant_id).secret

    def client(self, key: str, address: str | None = None) -> Client:
        return Client(address or self.gateway, key, ledger_address=self.ledger)

    def tenant_client(self, name: str) -> Client:
        return self.client(self.tenant_key(name))


def stored_seqs(events: list[RunEvent]) -> list[int]:
    """The seqs of the stored events among `events` (live ones repeat the last stored seq)."""
    return [event.seq for event in events if not event.live]


def start_streaming(
    client: Client, prompt: str, max_tokens: int
) -> tuple[list[RunEvent], Iterator[RunEvent]]:
    """Starts a greedy run of `max_tokens` and reads it until its second batch of tokens:
    the events so far, and the rest of the stream."""
    events = iter(
        client.generate(prompt, model="tiny", max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    seen = [next(events)]
    while sum(e.kind == "streaming" for e in seen) < 2:
        seen.append(next(events))
    return seen, events


@contextmanager
def running_stack(
    infra: Endpoints,
    template_database: str,
    model_dir: Path,
    extra_env: Mapping[str, str] | None = None,
    gateway_listen: str = "127.0.0.1:0",
    replicas: Mapping[str, int] | None = None,
    tls: tuple[Path, Path] | None = None,
    adapters: Mapping[str, Path] | None = None,
    model_name: str = "tiny",
) -> Iterator[tuple[Stack, Services]]:
    """The four services on a database and a topic of their own; stopped on the way out.
    `adapters` (name -> PEFT directory for the tiny model) go to the worker and admission."""
    name = f"e2e_{uuid.uuid4().hex}"
    database_url = create_database_from_template(infra.database_url, template_database, name)
    topic = f"e2e-{uuid.uuid4()}"
    ensure_topics(infra.kafka_bootstrap, [topic], 4)
    config = StackConfig(
        database_url=database_url,
        kafka_bootstrap=infra.kafka_bootstrap,
        model_name=model_name,
        model_dir=model_dir,
        admin_token=ADMIN_TOKEN,
        internal_token=INTERNAL_TOKEN,
        topic=topic,
        num_kv_blocks=NUM_KV_BLOCKS,
        gateway_listen=gateway_listen,
        tls_cert=tls[0] if tls else None,
        tls_key=tls[1] if tls else None,
        adapters=adapters or {},
        extra_env={
            "TOLLGATE_LEDGER_SWEEP_GRACE": "3",
            "TOLLGATE_MAX_TOKENS": "4096",
            **(extra_env or {}),
        },
    )
    # TOLLGATE_E2E_LOGS keeps the services' logs for a look after the run, a folder per
    # stack (named as its database).
    with tempfile.TemporaryDirectory(prefix="tollgate-e2e-") as scratch:
        kept = os.environ.get("TOLLGATE_E2E_LOGS")
        logs = Path(kept) / name if kept else Path(scratch)
        services = Services(config, logs, replicas)
        processes = services.start()
        admin = AdminClient(
            processes["admission"].address,
            ADMIN_TOKEN,
            ledger_address=processes["ledger"].address,
            root_certificates=tls[0] if tls else None,
        )
        try:
            yield (
                Stack(
                    gateway=processes["admission"].address,
                    http=processes["admission"].endpoints["http"],
                    ledger=processes["ledger"].address,
                    worker=processes["worker"].address,
                    database_url=database_url,
                    admin=admin,
                    metrics={name: p.metrics_port for name, p in processes.items()},
                    log_dir=logs,
                ),
                services,
            )
        finally:
            services.stop()
            drop_database(infra.database_url, name)


@pytest.fixture(scope="package")
def stack(infra: Endpoints, template_database: str, tiny_model_dir: Path) -> Iterator[Stack]:
    with running_stack(infra, template_database, tiny_model_dir) as (stack, _):
        yield stack


def paste_design_snippet(
    marker: str, stack: Stack, tmp_path: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Runs docs/DESIGN.md's Python block after `<!-- marker -->` as a user pastes it, in a
    directory whose `.tollgate/stack/stack.json` names this stack (its model as `tiny`)."""
    design = (Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md").read_text()
    block = design.split(f"<!-- {marker} -->", 1)[1].split("```", 2)[1]
    snippet = textwrap.dedent(block.split("\n", 1)[1]).replace("smollm2-135m-instruct", "tiny")
    (tmp_path / ".tollgate" / "stack").mkdir(parents=True)
    stack_file = {"http": stack.http, "api_key": stack.tenant_key(marker)}
    (tmp_path / ".tollgate" / "stack" / "stack.json").write_text(json.dumps(stack_file))
    return subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
