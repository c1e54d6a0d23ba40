"""The engine in a child process: same outputs as in-process, refusals at once, and open
streams fail (never hang) when the child stops or dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psutil
import pytest

from engine.config import EngineConfig
from engine.errors import ModelLoadError, RequestError
from engine.front import EngineClosedError, RequestStream
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.process_engine import ProcessEngine
from engine.sampling import SamplingParams

CONFIG = EngineConfig(num_kv_blocks=256, block_size=4, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ENDLESS = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
# A started engine and every output its step callback saw.
Started = tuple[ProcessEngine, list[RequestOutput]]


async def collect(stream: RequestStream) -> list[RequestOutput]:
    return [out async for out in stream]


@pytest.fixture
async def started(tiny_dir: Path) -> AsyncIterator[Started]:
    seen: list[RequestOutput] = []
    engine = await ProcessEngine.start(tiny_dir, CONFIG, on_step=seen.extend)
    try:
        yield engine, seen
    finally:
        await engine.shutdown()


async def test_streams_match_the_engine_in_process(
    make_engine: Callable[..., LLMEngine], started: Started
) -> None:
    sync = make_engine()
    prompts = [sync.tokenizer.encode(p) for p in ("the toll gate", "a cache block", "tenant")]
    expected = [r.token_ids for r in sync.generate(prompts, GREEDY)]
    engine, seen = started
    streams = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for outs, tokens in zip(results, expected, strict=True):
        assert tuple(t for o in outs for t in o.new_token_ids) == tokens
        assert outs[-1].finish_reason == "length"
    assert sorted(o.request_id for o in seen) == sorted(
        o.request_id for outs in results for o in outs
    )
    assert engine.num_free_blocks == engine.limits.num_total_blocks


async def test_on_step_sees_each_output_before_its_stream(
    started: Started,
) -> None:
    engine, seen = started
    outputs = []
    async for output in engine.add_request("r", [5, 6, 7], GREEDY):
        assert any(s is output for s in seen)
        outputs.append(output)
    assert len(outputs) == len(seen) and outputs[-1].finished


async def test_bad_requests_are_refused_at_once(
    started: Started,
) -> None:
    engine, _ = started
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    too_long = [5] * engine.limits.max_model_len
    with pytest.raises(RequestError, match="at most"):
        engine.add_request("long", too_long, GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("vocab", [engine.limits.vocab_size], GREEDY)
    with pytest.raises(TypeError):
        engine.add_request("text", "a prompt", GREEDY)  # type: ignore[arg-type]
    engine.add_request("dup", [5, 6], GREEDY)
    with pytest.raises(RequestError, match="in use"):
        engine.add_request("dup", [5, 6], GREEDY)


async def test_logprobs_and_constrained_outputs_cross_the_process_boundary(
    make_engine: Callable[..., LLMEngine], started: Started
) -> None:
    schema = '{"enum": ["yes", "no", "maybe"]}'
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=12, temperature=0, json_schema=schema, logprobs=0),
    ]
    expected = make_engine().generate([[5, 6, 7], [8, 9]], params)
    engine, _ = started
    streams = [engine.add_request(f"r{i}", p, params[i]) for i, p in enumerate([[5, 6, 7], [8, 9]])]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for outs, want in zip(results, expected, strict=True):
        assert tuple(e for o in outs for e in o.logprobs) == want.logprobs
        assert "".join(o.text_delta for o in outs) == want.text
        assert outs[-1].finish_reason == want.finish_reason
    assert json.loads(expected[1].text) in ("yes", "no", "maybe")
    refused = engine.add_request("bad", [5], SamplingParams(json_schema="{nope"))
    with pytest.raises(RequestError, match="json_schema"):
        await collect(refused)


async def test_abort_ends_the_stream_and_frees_the_blocks(
    started: Started,
) -> None:
    engine, _ = started
    stream = engine.add_request("long", [5, 6, 7], ENDLESS)
    first = await stream.__anext__()
    assert not first.finished and engine.num_free_blocks < engine.limits.num_total_blocks
    engine.abort("long")
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort"
    assert engine.num_free_blocks == engine.limits.num_total_blocks


async def test_a_dead_child_fails_open_streams(tiny_dir: Path) -> None:
    engine = await ProcessEngine.start(tiny_dir, CONFIG)
    try:
        stream = engine.add_request("r", [5, 6, 7], ENDLESS)
        await stream.__anext__()
        engine._process.kill()
        with pytest.raises(EngineClosedError, match="engine process failed"):
            await asyncio.wait_for(collect(stream), 30)
        with pytest.raises(EngineClosedError):
            engine.add_request("after", [5], GREEDY)
    finally:
        await engine.shutdown()


async def test_shutdown_stops_the_child_and_fails_open_streams(tiny_dir: Path) -> None:
    engine = await ProcessEngine.start(tiny_dir, CONFIG)
    stream = engine.add_request("r", [5, 6, 7], ENDLESS)
    await engine.shutdown()
    with pytest.raises(EngineClosedError):
        await collect(stream)
    with pytest.raises(EngineClosedError):
        engine.add_request("after", [5], GREEDY)
    assert not engine._process.is_alive() and engine._process.exitcode == 0


async def test_the_child_runs_at_the_niceness_it_is_given(tiny_dir: Path) -> None:
    engine = await ProcessEngine.start(tiny_dir, CONFIG, niceness=3)
    try:
        assert psutil.Process(engine._process.pid).nice() == os.nice(0) + 3
    finally:
        await engine.shutdown()


async def test_a_model_that_cannot_load_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        await ProcessEngine.start(tmp_path, CONFIG)


async def test_commands_never_wait_on_the_event_loop_for_a_busy_child(tiny_dir: Path) -> None:
    """A stopped child reads nothing, as a child in a long step would not: requests whose
    commands overflow the pipe's buffer still return at once, and run once it reads."""
    engine = await ProcessEngine.start(tiny_dir, CONFIG)
    pid = engine._process.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    # Resumes the child whatever happens below; had adding blocked, only this would end it.
    resume = threading.Timer(10.0, os.kill, (pid, signal.SIGCONT))
    resume.start()
    try:
        # About 3 bytes a token, 200 times: far more than a pipe holds.
        prompt = [5] * 1000
        one_token = SamplingParams(max_tokens=1, temperature=0)
        started = time.monotonic()
        streams = [engine.add_request(f"r{i}", prompt, one_token) for i in range(200)]
        adding = time.monotonic() - started
        os.kill(pid, signal.SIGCONT)
        assert adding < 5.0, f"adding waited {adding:.1f}s for the child"
        for i in range(199):
            engine.abort(f"r{i}")
        ends = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        assert {outs[-1].finish_reason for outs in ends[:-1]} <= {"abort", "length"}
        assert ends[-1][-1].finish_reason == "length"
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
        await engine.shutdown()


async def test_a_suspended_stream_pauses_and_goes_on_without_a_gap(
    make_engine: Callable[..., LLMEngine], started: Started
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = make_engine().generate([[5, 6, 7]], params)[0].token_ids
    engine, _ = started
    assert engine.suspends
    other = engine.add_request("other", [8, 9], ENDLESS)
    stream = engine.add_request("long", [5, 6, 7], params)
    first = await stream.__anext__()
    engine.suspend("long")
    for _ in range(5):  # steps go on without it
        await other.__anext__()
    engine.resume("long")
    rest = await collect(stream)
    assert first.new_token_ids + tuple(t for o in rest for t in o.new_token_ids) == expected
    assert rest[-1].metrics.num_preemptions == 1
    engine.abort("other")
