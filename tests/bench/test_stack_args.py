"""`bench.stack`'s command line, how `--engine-kind sim` turns rates into streams, and how
the sides of `--engine-kind llama-server` take turns."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from bench.stack import parse_args
from bench.stack_anchor import PROMPT_TOKENS, Level, Timing, prompts_of
from bench.stack_engines import rounds_at, sim_kv_blocks, sim_streams
from bench.stack_sides import RequestTiming, StackWorkload, take_turns


def test_each_engine_kind_has_its_defaults() -> None:
    builtin = parse_args([])
    assert (builtin.engine_kind, builtin.concurrencies, builtin.rounds) == ("builtin", [16], 1)
    llama = parse_args(["--engine-kind", "llama-server"])
    assert (llama.concurrencies, llama.rounds, llama.max_tokens) == ([1, 16], None, 64)
    assert [rounds_at(llama, c) for c in (1, 16, 64)] == [32, 2, 1]
    assert parse_args(["--engine-kind", "llama-server", "--quick"]).concurrencies == [1, 4]
    sim = parse_args(["--engine-kind", "sim"])
    assert (sim.sim_rates, sim.sim_step_ms) == ([1000, 5000, 20000], 20.0)
    assert parse_args(["--engine-kind", "sim", "--sim-rates", "300"]).sim_rates == [300]


@pytest.mark.parametrize(
    "argv",
    [
        ["--sim-rates", "1000"],
        ["--engine-kind", "sim", "--concurrency", "4"],
        ["--engine-kind", "sim", "--sim-rates", "0"],
        ["--engine-kind", "llama-server", "--front", "http"],
        ["--engine-kind", "llama-server", "--model", "tiny"],
    ],
)
def test_contradictory_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_a_rate_is_streams_at_one_token_a_step_and_the_pool_holds_them() -> None:
    assert [sim_streams(rate, 20.0) for rate in (1000, 5000, 20000)] == [20, 100, 400]
    assert sim_streams(10, 20.0) == 1
    # Two waves of two runs: 10 + 34 prompt tokens and 16 output tokens each.
    work = StackWorkload(["a", "b", "c", "d"], [[1] * 10, [1] * 34, [1], [1]], 16, 2)
    assert sim_kv_blocks([work], 16, 0) == 2 * (2 + 4)
    assert sim_kv_blocks([work], 16, 512) == 512


def test_sides_take_turns_round_by_round_with_the_same_prompts() -> None:
    work = StackWorkload(["a", "b", "c", "d", "e", "f"], [[1]] * 6, 4, 2)
    calls: list[tuple[str, int]] = []

    def side(name: str) -> Callable[[int], Awaitable[RequestTiming]]:
        async def request(i: int) -> RequestTiming:
            calls.append((name, i))
            return RequestTiming(submitted=0.0, finished=1.0, num_tokens=4)

        return request

    alone, stack = asyncio.run(take_turns(work, {"alone": side("alone"), "stack": side("stack")}))
    assert [name for name, _ in calls[::2]] == [
        "alone",
        "stack",
        "stack",
        "alone",
        "alone",
        "stack",
    ]
    assert [[t.num_tokens for t in wave] for wave in alone.rounds] == [[4, 4]] * 3
    assert sorted(calls) == sorted((name, i) for name in ("alone", "stack") for i in range(6))
    assert alone.cpu.wall_seconds > 0 and stack.output_tokens == 24


def test_the_anchor_has_its_defaults_and_runs_alone() -> None:
    anchor = parse_args(["--anchor", "llama-server"])
    assert (anchor.concurrencies, anchor.max_tokens) == ([1, 16, 64], 128)
    assert anchor.precisions == ("int8", "fp32")
    quick = parse_args(["--anchor", "llama-server", "--quick", "--precision", "int8"])
    assert (quick.concurrencies, quick.max_tokens, quick.precisions) == ([1, 4], 32, ("int8",))
    for other in (["--front", "http"], ["--engine-kind", "sim"], ["--model", "tiny"]):
        with pytest.raises(SystemExit):
            parse_args(["--anchor", "llama-server", *other])


class Words:
    """A tokenizer of words, enough for the prompts' length."""

    def encode(self, text: str) -> list[str]:
        return text.split()


def test_each_levels_prompts_are_its_own() -> None:
    first = prompts_of(Words(), 4, "0-quiet-1")  # type: ignore[arg-type]
    again = prompts_of(Words(), 4, "0-quiet-1")  # type: ignore[arg-type]
    other = prompts_of(Words(), 4, "0-quiet-16")  # type: ignore[arg-type]
    assert first == again
    assert all(len(p.split()) >= PROMPT_TOKENS for p in first)
    # No two share their words after the label: no prompt cache holds one for another.
    tails = [p.split()[2:10] for p in first + other]
    assert len({tuple(t) for t in tails}) == len(tails)


def test_a_level_cut_off_counts_what_ended() -> None:
    ended = Timing(0.0, [0.1, 0.2, 0.3], 3)
    level = Level("x", 4, [ended], 10.0, finished=False)
    figures = level.figures()
    assert figures["tokens_per_s"] == 0.3 and figures["requests_ended"] == 1
    assert figures["finished"] is False and figures["ttft_p50_ms"] == 100.0
