"""A worker killed in the middle of a stream, with real processes throughout."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.stack.infra import Endpoints
from services.stack.launcher import ServiceProcess, Services
from tests.e2e.conftest import Stack, running_stack, start_streaming, stored_seqs

MODEL = "tiny"
# The worker's default: a run's streaming events are stored every this many tokens.
STORE_EVERY_TOKENS = 16
# The scheduler gives up on a silent worker after this many seconds.
WORKER_TIMEOUT = "2"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def lone_worker(
    infra: Endpoints, template_database: str, tiny_model_dir: Path
) -> Iterator[tuple[Stack, Services]]:
    """A stack of its own: this module kills its worker."""
    env = {"TOLLGATE_WORKER_TIMEOUT": WORKER_TIMEOUT}
    with running_stack(infra, template_database, tiny_model_dir, env) as started:
        yield started


def start_second_worker(services: Services) -> ServiceProcess:
    """A worker that registers itself with the scheduler, as added capacity would."""
    worker = ServiceProcess(
        "worker-2",
        "services.worker",
        {
            **services.common_env(),
            **services.worker_env(),
            "TOLLGATE_WORKER_ID": "worker-2",
            "TOLLGATE_SCHEDULER_ADDRESS": services.processes["scheduler"].address,
        },
        services.log_dir / "worker-2.log",
    )
    worker.start()
    worker.wait_ready()
    return worker


def test_a_run_streaming_on_a_killed_worker_fails_and_is_billed_for_what_it_delivered(
    lone_worker: tuple[Stack, Services],
) -> None:
    stack, services = lone_worker
    client = stack.tenant_client("worker-lost")
    # The first run holds most of the worker's KV blocks, so the second one waits.
    seen, events = start_streaming(client, "long", 1900)
    waiting = client.generate("waits", model=MODEL, max_tokens=700, ignore_eos=True)
    waiting_events = iter(waiting)
    queued = next(waiting_events)
    assert queued.kind == "queued"

    # The worker and its engine process die at once, mid-stream.
    os.killpg(services.processes["worker"].pid, signal.SIGKILL)
    seen.extend(events)

    assert stored_seqs(seen) == list(range(1, len(stored_seqs(seen)) + 1))
    assert [e.kind for e in seen][-2:] == ["failed", "billed"]
    failed, billed = seen[-2:]
    assert failed.error_code == "WORKER_LOST"
    # The stream as stored is the one the client saw, but for the tokens it saw live after
    # the worker's last store (at most one store's worth): those are in neither the
    # run's record nor its bill.
    stored = list(client.stream_run(seen[0].run_id))
    assert [(e.seq, e.kind) for e in stored] == [(e.seq, e.kind) for e in seen if not e.live]
    stored_ids = [t for e in stored for t in e.token_ids]
    seen_ids = [t for e in seen for t in e.token_ids]
    assert seen_ids[: len(stored_ids)] == stored_ids
    assert len(seen_ids) - len(stored_ids) <= 2 * STORE_EVERY_TOKENS
    assert failed.usage is not None and failed.usage.output_tokens == len(stored_ids)
    output = next(e for e in billed.entries if e.billing_type == "output_tokens")
    assert output.quantity == len(stored_ids)

    # The waiting run was never assigned: it stays queued until a worker has room.
    assert client.get_run(queued.run_id).state == "queued"
    second = start_second_worker(services)
    try:
        rest = list(waiting_events)
    finally:
        second.stop()
    assert [e.kind for e in rest][-2:] == ["completed", "billed"]
    assert sum(len(e.token_ids) for e in rest if e.kind == "streaming") == 700
    assert next(e for e in rest if e.kind == "prefill").worker_id == "worker-2"
    assert stack.admin.get_reconciliation().ok
