"""A LoRA adapter through four real processes: made by `tollgate models adapter-init`,
served beside its base model by the same worker, billed under its own name, and cached
apart from the base model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from services.stack.infra import Endpoints
from tests.e2e.conftest import Stack, running_stack
from tests.e2e.test_prefix_cache import LONG_PROMPT
from tollgate import Client
from tollgate.cli import main as tollgate_main
from tollgate.types import RunEvent

ADAPTER = "tiny-sql"


@pytest.fixture(scope="module")
def adapter_stack(
    infra: Endpoints,
    template_database: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    adapter_dir = tmp_path_factory.mktemp("adapter") / ADAPTER
    command = ["models", "adapter-init", str(adapter_dir), "--base", str(tiny_model_dir)]
    assert tollgate_main([*command, "--rank", "8", "--seed", "3"]) == 0
    adapters = {ADAPTER: adapter_dir}
    with running_stack(infra, template_database, tiny_model_dir, adapters=adapters) as (s, _):
        yield s


def greedy(client: Client, model: str, prompt: str, max_tokens: int) -> list[RunEvent]:
    return list(
        client.generate(prompt, model=model, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )


def output_token_ids(events: list[RunEvent]) -> list[int]:
    return [token for event in events for token in event.token_ids]


def cached_prompt_tokens(events: list[RunEvent]) -> int:
    [completed] = [e for e in events if e.kind == "completed"]
    assert completed.usage is not None and completed.usage.prompt_tokens > 64
    return completed.usage.cached_prompt_tokens


def billed_models(stack: Stack, run_id: str) -> set[str]:
    engine = sa.create_engine(stack.database_url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT model FROM ledger_entries WHERE run_id = :r"), {"r": run_id}
        ).all()
    engine.dispose()
    return {model for (model,) in rows}


def test_an_adapter_answers_otherwise_than_its_base_and_is_billed_under_its_name(
    adapter_stack: Stack,
) -> None:
    client = adapter_stack.tenant_client("adapter")
    base = greedy(client, "tiny", "the toll is", 16)
    tuned = greedy(client, ADAPTER, "the toll is", 16)
    assert len(output_token_ids(tuned)) == len(output_token_ids(base)) == 16
    assert output_token_ids(tuned) != output_token_ids(base)
    # Greedy decoding under the same adapter is deterministic: the adapter, not noise.
    assert output_token_ids(greedy(client, ADAPTER, "the toll is", 16)) == output_token_ids(tuned)
    assert output_token_ids(greedy(client, "tiny", "the toll is", 16)) == output_token_ids(base)
    assert tuned[-1].kind == base[-1].kind == "billed"
    assert billed_models(adapter_stack, tuned[0].run_id) == {ADAPTER}
    assert billed_models(adapter_stack, base[0].run_id) == {"tiny"}


def test_the_gateway_lists_the_adapter_with_its_base(adapter_stack: Stack) -> None:
    models = {m.name: m for m in adapter_stack.tenant_client("adapter-list").list_models()}
    assert (models["tiny"].base, models[ADAPTER].base) == ("", "tiny")
    assert models[ADAPTER].context_length == models["tiny"].context_length > 0


def test_an_adapter_never_reads_the_base_models_cached_prompt(adapter_stack: Stack) -> None:
    client = adapter_stack.tenant_client("adapter-cache")
    assert cached_prompt_tokens(greedy(client, "tiny", LONG_PROMPT, 4)) == 0
    assert cached_prompt_tokens(greedy(client, "tiny", LONG_PROMPT, 4)) > 0
    # The base model's blocks are cached, yet the adapter's first run finds none.
    assert cached_prompt_tokens(greedy(client, ADAPTER, LONG_PROMPT, 4)) == 0
    assert cached_prompt_tokens(greedy(client, ADAPTER, LONG_PROMPT, 4)) > 0
