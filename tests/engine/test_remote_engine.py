"""RemoteEngine over real HTTP against a server that replays vLLM's, SGLang's and
llama-server's recorded wire format (the first two do not run without a GPU) and misbehaves
on cue: refusals, malformed
chunks, a stream cut or stalled, a server that is not ready. The same engine against a
real llama-server is tested end to end in tests/e2e/test_llama_server.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from engine.front import EngineClosedError
from engine.outputs import RequestOutput
from engine.remote_engine import EngineUnavailable, RemoteConfig, RemoteEngine
from engine.sampling import SamplingParams

FIXTURES = Path(__file__).parents[1] / "fixtures" / "engines"


@dataclass
class Replay:
    """What the server answers next, and what it was sent."""

    kind: str = "vllm"
    # "ok", "refuse", "malformed", "cut", "stall", "error500"
    mode: str = "ok"
    stream: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    healthy: bool = True
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    metrics: str = ""


async def serve(replay: Replay, request: web.Request) -> web.StreamResponse:
    replay.bodies.append(await request.json())
    if replay.mode == "refuse":
        return web.json_response({"error": {"message": "bad model", "code": 404}}, status=404)
    if replay.mode == "error500":
        return web.json_response({"error": {"message": "oom"}}, status=500)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    lines = list(replay.stream)
    if replay.mode == "malformed":
        lines = [lines[0], '{"choices": [{"text": 5}]}']
    try:
        for index, line in enumerate(lines):
            if replay.mode == "cut" and index == 2:
                request.transport.close()  # type: ignore[union-attr]
                return response
            if replay.mode in ("stall", "slow") and index == 1:
                await asyncio.sleep(3600)
            await response.write(f"data: {line}\n\n".encode())
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        replay.disconnected.set()
        raise


@pytest.fixture
async def replay() -> AsyncIterator[tuple[Replay, str]]:
    state = Replay()

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200 if state.healthy else 503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=state.metrics) if state.metrics else web.Response(status=404)

    async def generate(request: web.Request) -> web.StreamResponse:
        return await serve(state, request)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/generate", generate)
    app.router.add_post("/completion", generate)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def fixture(kind: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / f"{kind}.json").read_text()))


def load(kind: str) -> list[str]:
    return list(fixture(kind)["stream"])


def config(url: str, kind: str = "vllm", **overrides: Any) -> RemoteConfig:
    settings: dict[str, Any] = dict(
        kind=kind, url=url, model="my-model", vocab_size=1000, max_model_len=256,
        chunk_timeout=0.5, ready_timeout=0.5, poll_interval=0.05,
    )  # fmt: skip
    return RemoteConfig(**{**settings, **overrides})


async def collect(engine: RemoteEngine, request_id: str, **params: Any) -> list[RequestOutput]:
    stream = engine.add_request(request_id, [1, 2, 3], SamplingParams(max_tokens=4, **params))
    return [output async for output in stream]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_a_run_streams_its_tokens_and_ends_with_the_servers_counts(
    replay: tuple[Replay, str], kind: str
) -> None:
    state, url = replay
    state.kind, state.stream = kind, load(kind)
    seen: list[RequestOutput] = []
    engine = await RemoteEngine.start(config(url, kind), on_step=seen.extend)
    try:
        outputs = await collect(engine, "r1", temperature=0, seed=7)
    finally:
        await engine.shutdown()
    assert [t for o in outputs for t in o.new_token_ids] == [10, 11, 12, 13]
    assert "".join(o.text_delta for o in outputs) == "abcd"
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    last = outputs[-1]
    assert last.finish_reason == "length"
    assert last.metrics.num_prompt_tokens == 3 and last.metrics.num_output_tokens == 4
    assert last.metrics.kv_block_seconds > 0 and last.metrics.ttft is not None
    assert seen == outputs  # the worker's step callback sees what the stream sees
    assert state.bodies[0]["prompt" if kind == "vllm" else "input_ids"] == [1, 2, 3]


async def test_the_output_is_bounded_by_the_servers_context(replay: tuple[Replay, str]) -> None:
    state, url = replay
    state.stream = load("vllm")
    engine = await RemoteEngine.start(config(url, max_model_len=8))
    try:
        stream = engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=100))
        [output async for output in stream]
    finally:
        await engine.shutdown()
    assert state.bodies[0]["max_tokens"] == 5


async def test_a_stop_token_id_ends_the_run_at_that_token(replay: tuple[Replay, str]) -> None:
    state, url = replay
    state.stream = load("vllm")
    engine = await RemoteEngine.start(config(url))
    try:
        outputs = await collect(engine, "r1", stop_token_ids=(11,))
    finally:
        await engine.shutdown()
    assert [t for o in outputs for t in o.new_token_ids] == [10, 11]
    assert outputs[-1].finish_reason == "stop"


@pytest.mark.parametrize("mode", ["refuse", "malformed"])
async def test_a_run_answered_wrongly_fails_alone(replay: tuple[Replay, str], mode: str) -> None:
    state, url = replay
    state.stream, state.mode = load("vllm"), mode
    engine = await RemoteEngine.start(config(url))
    try:
        outputs = await collect(engine, "r1")
        assert outputs[-1].finish_reason == "error" and outputs[-1].error
        assert not engine.lost.is_set()
        state.mode = "ok"
        assert (await collect(engine, "r2"))[-1].finish_reason == "length"
    finally:
        await engine.shutdown()
    if mode == "refuse":
        assert "404" in outputs[-1].error and "bad model" in outputs[-1].error


@pytest.mark.parametrize("mode", ["cut", "stall", "error500"])
async def test_a_server_gone_or_stuck_loses_every_run(
    replay: tuple[Replay, str], mode: str
) -> None:
    state, url = replay
    state.stream, state.mode = load("vllm"), mode
    engine = await RemoteEngine.start(config(url))
    try:
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(collect(engine, "r1"), 5)
        assert engine.lost.is_set()
        with pytest.raises(EngineClosedError):
            engine.add_request("r2", [1], SamplingParams())
    finally:
        await engine.shutdown()


async def test_an_abort_closes_the_stream_and_ends_the_run(replay: tuple[Replay, str]) -> None:
    state, url = replay
    state.stream, state.mode = load("vllm"), "slow"
    engine = await RemoteEngine.start(config(url, chunk_timeout=30))
    try:
        stream = engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=4))
        first = await anext(stream)
        assert first.new_token_ids == (10,)
        engine.abort("r1")
        rest = [output async for output in stream]
        assert rest[-1].finish_reason == "abort" and rest[-1].metrics.num_output_tokens == 1
        await asyncio.wait_for(state.disconnected.wait(), 2)
        assert not engine.lost.is_set()
    finally:
        await engine.shutdown()


async def test_start_waits_for_the_server_to_be_ready(replay: tuple[Replay, str]) -> None:
    state, url = replay
    state.healthy = False
    with pytest.raises(EngineUnavailable, match="503"):
        await RemoteEngine.start(config(url))
    with pytest.raises(EngineUnavailable):
        await RemoteEngine.start(config("http://127.0.0.1:9"))


async def test_a_server_holding_back_requests_is_saturated(replay: tuple[Replay, str]) -> None:
    state, url = replay
    state.metrics = 'vllm:num_requests_waiting{model_name="my-model"} 2.0\n'
    engine = await RemoteEngine.start(config(url))
    try:
        await until(lambda: engine.saturated)
        state.metrics = 'vllm:num_requests_waiting{model_name="my-model"} 0.0\n'
        await until(lambda: not engine.saturated)
    finally:
        await engine.shutdown()


async def until(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", ["vllm", "sglang", "llama-server"])
async def test_each_output_carries_the_logprobs_of_its_tokens(
    replay: tuple[Replay, str], kind: str
) -> None:
    state, url = replay
    example = fixture(kind)["logprobs_example"]
    state.stream = example["stream"]
    engine = await RemoteEngine.start(config(url, kind))
    try:
        outputs = await collect(engine, "r1", logprobs=2)
    finally:
        await engine.shutdown()
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in outputs)
    assert [lp.token_id for o in outputs for lp in o.logprobs] == example["expected"]["token_ids"]
    got = [
        [lp.token_id, lp.logprob, [list(p) for p in lp.top]] for o in outputs for lp in o.logprobs
    ]
    assert got == example["expected"]["logprobs"]
    assert outputs[-1].finish_reason == "length"
    for name, value in example["request_delta"].items():
        assert state.bodies[0][name] == value


async def test_logprobs_end_with_the_stop_token_the_engine_stops_at(
    replay: tuple[Replay, str],
) -> None:
    state, url = replay
    state.stream = fixture("vllm")["logprobs_example"]["stream"]
    engine = await RemoteEngine.start(config(url))
    try:
        outputs = await collect(engine, "r1", logprobs=2, stop_token_ids=(11,))
    finally:
        await engine.shutdown()
    assert [lp.token_id for o in outputs for lp in o.logprobs] == [10, 11]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].logprobs[-1].token_id == 11


async def test_a_run_its_server_cannot_constrain_fails_unsent(replay: tuple[Replay, str]) -> None:
    """SGLang takes no Lark grammar: the run fails rather than run unconstrained."""
    state, url = replay
    state.stream = load("sglang")
    engine = await RemoteEngine.start(config(url, "sglang"))
    try:
        outputs = await collect(engine, "r1", grammar="start: /a/")
        assert outputs[-1].finish_reason == "error" and "grammar" in outputs[-1].error
        assert not engine.lost.is_set() and state.bodies == []
    finally:
        await engine.shutdown()
