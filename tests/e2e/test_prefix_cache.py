"""Prefix caching through four real processes: a tenant reuses its own prompt's KV blocks,
never another tenant's."""

from __future__ import annotations

from tests.e2e.conftest import Stack
from tollgate import Client

# Several full KV blocks of prompt: only full blocks are cached.
LONG_PROMPT = "a toll gate lets through only those who pay the toll, one at a time; " * 8


def cached_prompt_tokens(client: Client) -> int:
    events = list(client.generate(LONG_PROMPT, model="tiny", max_tokens=4, temperature=0))
    [completed] = [e for e in events if e.kind == "completed"]
    assert completed.usage is not None and completed.usage.prompt_tokens > 64
    return completed.usage.cached_prompt_tokens


def test_the_same_long_prompt_shares_blocks_within_a_tenant_only(stack: Stack) -> None:
    first, second = stack.tenant_client("cache-a"), stack.tenant_client("cache-b")
    assert cached_prompt_tokens(first) == 0
    assert cached_prompt_tokens(first) > 0
    # The first tenant's blocks are still cached: the second tenant's run finds none.
    assert cached_prompt_tokens(second) == 0
    assert cached_prompt_tokens(second) > 0
