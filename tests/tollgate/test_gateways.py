"""The SDK and the CLI against several gateways: calls spread over them, and go on when
one is down."""

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.tollgate.fake_gateway import FakeServer, start_fake
from tollgate import AsyncClient, Client
from tollgate.cli import build_parser
from tollgate.commands.connection import resolve
from tollgate.transport import channel_target
from tollgate.types import RetryPolicy

FAST = RetryPolicy(max_attempts=10, initial_backoff=0.05, max_backoff=0.2)


@pytest.fixture
async def two_fakes() -> AsyncIterator[list[FakeServer]]:
    servers = [await start_fake() for _ in range(2)]
    yield servers
    for server in servers:
        await server.server.stop(0)


def generations(fake: FakeServer) -> int:
    return sum(method == "Generate" for method, _, _ in fake.gateway.calls)


def generate_all(addresses: str | list[str], num_runs: int) -> list[str]:
    texts = []
    with Client(addresses, "key-1", retry=FAST, timeout=5) as client:
        for _ in range(num_runs):
            with client.generate("hi", model="tiny") as stream:
                list(stream)
                texts.append(stream.text)
    return texts


async def test_calls_spread_over_every_gateway_and_skip_one_that_is_down(
    two_fakes: list[FakeServer],
) -> None:
    first, second = two_fakes
    texts = await asyncio.to_thread(generate_all, f"{first.address},{second.address}", 8)
    assert texts == ["Hello, world"] * 8
    assert generations(first) > 0 and generations(second) > 0

    await first.server.stop(0)
    before = generations(second)
    texts = await asyncio.to_thread(generate_all, [first.address, second.address], 4)
    assert texts == ["Hello, world"] * 4
    assert generations(second) - before == 4


async def test_the_asyncio_client_takes_several_gateways_too(
    two_fakes: list[FakeServer],
) -> None:
    async with AsyncClient([f.address for f in two_fakes], "key-1", retry=FAST) as client:
        for _ in range(6):
            async with client.generate("hi", model="tiny") as stream:
                [_ async for _ in stream]
                assert stream.text == "Hello, world"
    assert all(generations(f) > 0 for f in two_fakes)


def test_one_address_is_used_as_given_several_are_balanced() -> None:
    assert channel_target("gateway.example:443") == ("gateway.example:443", [])
    target, options = channel_target("localhost:5001, 127.0.0.1:5002")
    assert target == "ipv4:127.0.0.1:5001,127.0.0.1:5002"
    assert ("grpc.lb_policy_name", "round_robin") in options
    with pytest.raises(ValueError, match="host:port"):
        channel_target("a,b")


def test_the_cli_reads_every_gateway_from_the_stack_file(tmp_path: Path) -> None:
    stack = tmp_path / "stack.json"
    ledgers = [{"pid": 1, "address": "127.0.0.1:7001"}, {"pid": 2, "address": "127.0.0.1:7002"}]
    stack.write_text(
        json.dumps(
            {
                "gateway": "127.0.0.1:6001",
                "gateways": ["127.0.0.1:6001", "127.0.0.1:6002"],
                "services": {"ledger": ledgers},
            }
        )
    )
    args = build_parser().parse_args(["runs", "list", "--stack", str(stack)])
    connection = resolve(args, {})
    assert connection.gateway == "127.0.0.1:6001,127.0.0.1:6002"
    assert connection.ledger == "127.0.0.1:7001,127.0.0.1:7002"
