"""Tollgate in front of a real llama.cpp `llama-server` (built by `make llama-server`),
serving SmolLM2-135M-Instruct's GGUF: the same promises as with the built-in engine."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.dialects import waiting
from engine.model_dirs.fetch import FetchError, fetch_gguf, resolve_model
from engine.model_dirs.registry import KNOWN_MODELS, model_cache, model_index
from engine.tokenizer import Tokenizer
from services.stack.infra import Endpoints
from tests.e2e.conftest import Stack, running_stack
from tollgate.cli import main as tollgate
from tollgate.errors import InvalidArgumentError
from tools import llama_server
from tools.llama_server import LlamaServer

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
SLOTS = 4
# Two workers share the server, each with half its slots.
WORKERS = 2


@pytest.fixture(scope="module")
def served() -> tuple[Path, Path]:
    """The model's directory (admission's tokenizer) and the GGUF file llama-server runs."""
    if llama_server.find() is None:
        pytest.skip("llama-server is not built (make llama-server)")
    try:
        _, model_dir = resolve_model(MODEL)
        gguf = fetch_gguf(KNOWN_MODELS[MODEL], model_cache(), index=model_index())
    except FetchError as exc:
        pytest.skip(f"cannot fetch {MODEL}: {exc}")
    return model_dir, gguf


@pytest.fixture(scope="module")
def server(
    served: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama-server") / "llama-server.log"
    with LlamaServer(served[1], slots=SLOTS, context=4096, threads=1, log=log) as process:
        yield process


@pytest.fixture(scope="module")
def stack(
    infra: Endpoints, template_database: str, served: tuple[Path, Path], server: LlamaServer
) -> Iterator[Stack]:
    engine = {
        "TOLLGATE_ENGINE_KIND": "llama-server",
        "TOLLGATE_ENGINE_URL": server.url,
        "TOLLGATE_ENGINE_MAX_RUNS": str(SLOTS // WORKERS),
        "TOLLGATE_ENGINE_TIMEOUT": "20",
    }
    with running_stack(
        infra, template_database, served[0], engine, replicas={"worker": WORKERS}, model_name=MODEL
    ) as (stack, _):
        yield stack


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return dict(json.loads(answer.read()))


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return dict(json.loads(answer.read()))


def busy_slots(server: LlamaServer) -> int:
    with urllib.request.urlopen(server.url + "/slots", timeout=5) as answer:
        return sum(bool(slot.get("is_processing")) for slot in json.loads(answer.read()))


def wait_until_idle(server: LlamaServer, timeout: float = 10.0) -> float:
    """Seconds until no slot of the server is processing; fails after `timeout`."""
    start = time.monotonic()
    while busy_slots(server):
        assert time.monotonic() - start < timeout, "a slot stayed busy"
        time.sleep(0.02)
    return time.monotonic() - start


def test_greedy_output_equals_llama_servers_own(
    stack: Stack, server: LlamaServer, served: tuple[Path, Path]
) -> None:
    prompt = "The three primary colors are"
    client = stack.tenant_client("greedy")
    events = list(
        client.generate(prompt, model=MODEL, max_tokens=24, temperature=0, ignore_eos=True)
    )
    assert [e.kind for e in events][-2:] == ["completed", "billed"]
    ours = [t for e in events for t in e.token_ids]
    prompt_ids = Tokenizer.from_model_dir(served[0]).encode(prompt)
    own = post(
        server.url + "/completion",
        {"prompt": prompt_ids, "n_predict": 24, "temperature": 0, "top_k": 1,
         "ignore_eos": True, "return_tokens": True, "cache_prompt": False},
    )  # fmt: skip
    assert ours == own["tokens"]
    assert "".join(e.text for e in events) == own["content"]
    completed = events[-2]
    assert completed.usage is not None
    assert completed.usage.prompt_tokens == len(prompt_ids)
    assert completed.usage.output_tokens == 24


def deferred(server: LlamaServer) -> float:
    """Requests the server holds back for want of a free slot."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as answer:
        return waiting(answer.read().decode(), "llamacpp:requests_deferred") or 0.0


def test_workers_sharing_the_server_never_send_it_more_than_its_slots(
    stack: Stack, server: LlamaServer
) -> None:
    client = stack.tenant_client("shared")
    streams = [
        client.generate(f"Story number {i}:", model=MODEL, max_tokens=48, ignore_eos=True)
        for i in range(2 * SLOTS)
    ]
    results: list[list[Any]] = [[] for _ in streams]
    threads = [
        threading.Thread(target=lambda i=i: results[i].extend(streams[i]))
        for i in range(len(streams))
    ]
    for thread in threads:
        thread.start()
    most_busy, most_deferred = 0, 0.0
    while any(thread.is_alive() for thread in threads):
        most_busy = max(most_busy, busy_slots(server))
        most_deferred = max(most_deferred, deferred(server))
        time.sleep(0.05)
    assert all([e.kind for e in events][-2:] == ["completed", "billed"] for events in results)
    workers = {e.worker_id for events in results for e in events if e.kind == "prefill"}
    assert len(workers) == WORKERS
    assert most_busy <= SLOTS and most_deferred == 0


def test_a_run_larger_than_a_slot_of_the_server_is_refused_naming_max_tokens(
    stack: Stack, server: LlamaServer
) -> None:
    slot = int(get_json(server.url + "/props")["default_generation_settings"]["n_ctx"])
    client = stack.tenant_client("large")
    with pytest.raises(InvalidArgumentError) as refused:
        list(client.generate("Hello", model=MODEL, max_tokens=slot))
    assert "sampling.max_tokens" in str(refused.value) and f"{slot} tokens" in str(refused.value)


def test_a_stream_resumes_from_a_middle_seq(stack: Stack) -> None:
    client = stack.tenant_client("resume")
    seen = list(client.generate("Count to twenty:", model=MODEL, max_tokens=40, temperature=0))
    assert seen[0].run_id is not None
    events = list(client.stream_run(seen[0].run_id))  # as stored: the run has ended
    assert "".join(e.text for e in events) == "".join(e.text for e in seen)
    middle = events[len(events) // 2].seq
    tail = list(client.stream_run(events[0].run_id, starting_after=middle))
    assert [(e.seq, e.kind, e.text, e.token_ids) for e in tail] == [
        (e.seq, e.kind, e.text, e.token_ids) for e in events if e.seq > middle
    ]


def test_cancel_mid_stream_ends_the_run_and_frees_the_slot(
    stack: Stack, server: LlamaServer
) -> None:
    client = stack.tenant_client("cancel")
    stream = client.generate("Write a long story.", model=MODEL, max_tokens=900, ignore_eos=True)
    events = iter(stream)
    while next(events).kind != "streaming":
        pass
    assert busy_slots(server) == 1
    assert stream.run_id is not None
    client.cancel_run(stream.run_id)
    freed = wait_until_idle(server)
    rest = list(events)
    assert [e.kind for e in rest][-2:] == ["cancelled", "billed"]
    cancelled = rest[-2]
    delivered = sum(
        len(e.token_ids) for e in client.stream_run(stream.run_id) if e.kind == "streaming"
    )
    assert cancelled.usage is not None and 0 < cancelled.usage.output_tokens == delivered < 900
    print(f"slot free {freed:.3f} s after the cancel returned")


def test_a_client_that_goes_away_has_its_run_cancelled_after_its_grace(
    stack: Stack, server: LlamaServer
) -> None:
    client = stack.tenant_client("gone")
    with client.generate(
        "Tell me about the sea.", model=MODEL, max_tokens=900, ignore_eos=True, disconnect_grace=1
    ) as stream:
        events = iter(stream)
        while next(events).kind != "streaming":
            pass
        run_id = stream.run_id
    assert run_id is not None
    deadline = time.monotonic() + 30
    while client.get_run(run_id).state not in ("cancelled", "billed"):
        assert time.monotonic() < deadline, "the abandoned run was not cancelled"
        time.sleep(0.1)
    wait_until_idle(server)
    assert [e.kind for e in client.stream_run(run_id)][-2:] == ["cancelled", "billed"]


def test_two_tenants_with_one_prompt_share_no_cached_prefix(stack: Stack) -> None:
    prompt = "A shared system prompt that both tenants send, word for word. " * 8
    for name in ("first", "second"):
        client = stack.tenant_client(name)
        events = list(client.generate(prompt, model=MODEL, max_tokens=4, temperature=0))
        completed = events[-2]
        assert completed.kind == "completed" and completed.usage is not None
        assert completed.usage.cached_prompt_tokens == 0


def test_the_engine_server_killed_mid_run_and_restarted(stack: Stack, server: LlamaServer) -> None:
    client = stack.tenant_client("chaos")
    stream = client.generate("Describe a city.", model=MODEL, max_tokens=900, ignore_eos=True)
    events = iter(stream)
    seen = [next(events)]
    while seen[-1].kind != "streaming":
        seen.append(next(events))
    server.kill()
    rest = list(events)
    assert [e.kind for e in rest][-2:] == ["failed", "billed"]
    failed = rest[-2]
    assert failed.error_code == "ENGINE_ERROR"
    delivered = sum(len(e.token_ids) for e in [*seen, *rest] if e.kind == "streaming")
    assert failed.usage is not None and failed.usage.output_tokens == delivered > 0
    # Sent while the server is down, it waits in the queue and runs once it is back.
    waiting = client.generate("Hello", model=MODEL, max_tokens=8, temperature=0)
    first = next(iter(waiting))
    time.sleep(1.0)
    assert client.get_run(first.run_id).state == "queued"
    server.start()
    after = [first, *waiting]
    assert [e.kind for e in after][-2:] == ["completed", "billed"]


def test_zz_every_run_billed_once_and_reconcile_is_clean(stack: Stack) -> None:
    deadline = time.monotonic() + 30
    while not (report := stack.admin.get_reconciliation()).ok:
        assert time.monotonic() < deadline, report
        time.sleep(0.5)
    assert tollgate(["reconcile", "--database-url", stack.database_url]) == 0
