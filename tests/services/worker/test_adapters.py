"""A worker serving its base model and LoRA adapters of it on one engine: each adapter is
a model name of its own, the base model's runs are unchanged by them."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_dirs.adapter_init import init_adapter
from engine.sampling import SamplingParams
from services.core.config import ConfigError
from services.core.event_store import EventStore
from services.core.runs import StoredEvent
from services.worker.app import WorkerSettings
from tests.services.scheduler.helpers import wait_for
from tests.services.worker.running import PROMPT, leased_run, running_worker
from tollgate.v1 import worker_pb2

WORKER_ID = "worker-1"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_adapter(tmp_path_factory.mktemp("tiny-sql"), tiny_model_dir, rank=4, seed=3)


def _expected_tokens(model_dir: Path, adapter_dir: Path, adapter: str) -> list[int]:
    config = EngineConfig(num_kv_blocks=16, adapters=(("tiny-sql", str(adapter_dir)),))
    engine = LLMEngine.from_model_dir(model_dir, config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("r", list(PROMPT), params, adapter=adapter)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


async def _streamed(store: EventStore, run_id: str) -> list[int] | None:
    events: list[StoredEvent] = await store.read(run_id)
    if events[-1].kind != "completed":
        return None
    return [t for e in events if e.kind == "streaming" for t in e.payload["token_ids"]]


async def test_runs_for_the_base_and_an_adapter_share_the_worker(
    store: EventStore, tiny_model_dir: Path, adapter_dir: Path
) -> None:
    adapters = {"tiny-sql": adapter_dir}
    async with running_worker(store, tiny_model_dir, adapters=adapters) as worker:
        status = await worker.stub.GetWorkerStatus(worker_pb2.GetWorkerStatusRequest())
        assert (status.model, list(status.adapters)) == ("tiny", ["tiny-sql"])
        base = await leased_run(store, WORKER_ID, MAX_TOKENS)
        tuned = await leased_run(store, WORKER_ID, MAX_TOKENS)
        tuned.model = "tiny-sql"
        await worker.stub.AssignRun(base)
        await worker.stub.AssignRun(tuned)
        base_tokens = await wait_for(lambda: _streamed(store, base.run_id), timeout=30)
        tuned_tokens = await wait_for(lambda: _streamed(store, tuned.run_id), timeout=30)
        other = await leased_run(store, WORKER_ID, MAX_TOKENS)
        other.model = "tiny-chat"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.stub.AssignRun(other)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "'tiny-sql'" in (refused.value.details() or "")
    assert base_tokens == _expected_tokens(tiny_model_dir, adapter_dir, "")
    assert tuned_tokens == _expected_tokens(tiny_model_dir, adapter_dir, "tiny-sql")
    assert tuned_tokens != base_tokens


def test_adapters_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", "postgresql+psycopg://localhost/x")
    monkeypatch.setenv("TOLLGATE_KAFKA_BOOTSTRAP", "127.0.0.1:9092")
    monkeypatch.setenv("TOLLGATE_MODELS", "tiny=/models/tiny")
    monkeypatch.setenv("TOLLGATE_ADAPTERS", "tiny-sql=/adapters/sql, tiny-chat=/adapters/chat")
    adapters = WorkerSettings.from_env().engine.adapters
    assert adapters == (("tiny-sql", "/adapters/sql"), ("tiny-chat", "/adapters/chat"))
    monkeypatch.setenv("TOLLGATE_ADAPTERS", "tiny=/adapters/sql")
    with pytest.raises(ConfigError, match="base model.s name"):
        WorkerSettings.from_env()
