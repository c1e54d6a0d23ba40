from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from engine.async_engine import AsyncEngine, EngineClosedError
from engine.errors import RequestError
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def collect(stream: object) -> list:
    return [out async for out in stream]  # type: ignore[attr-defined]


async def test_concurrent_streams_match_the_sync_engine(
    make_engine: Callable[..., LLMEngine],
) -> None:
    prompts = ["the toll gate", "a cache block", "tenant model run"]
    expected = [r.token_ids for r in make_engine().generate(prompts, GREEDY)]
    engine = AsyncEngine(make_engine())
    try:
        streams = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    for outs, tokens in zip(results, expected, strict=True):
        assert tuple(t for o in outs for t in o.new_token_ids) == tokens
        assert outs[-1].finished and outs[-1].finish_reason == "length"


async def test_abort_ends_the_stream_and_frees_blocks(
    make_engine: Callable[..., LLMEngine],
) -> None:
    sync = make_engine()
    engine = AsyncEngine(sync)
    try:
        stream = engine.add_request(
            "long", "the toll gate", SamplingParams(max_tokens=500, ignore_eos=True)
        )
        first = await stream.__anext__()
        assert not first.finished
        engine.abort("long")
        rest = await collect(stream)
        assert rest[-1].finish_reason == "abort"
        with pytest.raises(RequestError):
            engine.add_request("bad", [], GREEDY)
    finally:
        await engine.shutdown()
    assert sync.num_free_blocks == sync.num_total_blocks


async def test_leaving_generate_early_aborts(make_engine: Callable[..., LLMEngine]) -> None:
    sync = make_engine()
    engine = AsyncEngine(sync)
    try:
        async for out in engine.generate(
            "g", "a cache", SamplingParams(max_tokens=500, ignore_eos=True)
        ):
            assert not out.finished
            break
        # The abort is processed by the step loop; wait for it to drain.
        for _ in range(200):
            if not sync.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
    finally:
        await engine.shutdown()
    assert sync.num_free_blocks == sync.num_total_blocks


async def test_shutdown_fails_open_streams(make_engine: Callable[..., LLMEngine]) -> None:
    engine = AsyncEngine(make_engine())
    stream = engine.add_request(
        "r", "hello", SamplingParams(max_tokens=900, ignore_eos=True, temperature=0)
    )
    await engine.shutdown()
    with pytest.raises(EngineClosedError):
        await collect(stream)
    with pytest.raises(EngineClosedError):
        engine.add_request("x", "hello", GREEDY)


async def test_on_step_sees_every_output_before_the_streams(
    make_engine: Callable[..., LLMEngine],
) -> None:
    seen: list[str] = []
    engine = AsyncEngine(
        make_engine(), on_step=lambda outs: seen.extend(o.request_id for o in outs)
    )
    try:
        outs = await collect(engine.add_request("r", "hello", GREEDY))
    finally:
        await engine.shutdown()
    assert seen == ["r"] * len(outs)
