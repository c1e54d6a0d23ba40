"""`python -m bench.engine --grammar`: throughput with structured outputs in the batch.

One run, the random workload of `bench.engine` (all requests at once, greedy, EOS
ignored): every other request carries a JSON schema (a list of items, unbounded, so that
most run to their max_tokens as the others do), against the same batch with none. A
constrained request that completes its JSON early ends there; the unconstrained batch is
then given each request's output length from the constrained one, so both batches
compute the same tokens and differ only in the grammar's work. Each batch runs three times,
alternately; the better of each counts. The grammar's time per constrained token is what
the constrained run spent computing masks (llguidance, all rows in one call), applying them
to the logits, and advancing the matchers, over the tokens sampled under a schema; its
share of that run gives the ratio the grammar's own work allows, which a busy machine's
noise between runs does not blur. Table on stdout, progress on stderr, and the last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.engine import Mix
from bench.models import model_dir as bench_model_dir
from bench.models import model_name
from bench.report import progress
from bench.workload import Workload, make_workload
from engine import decoding
from engine.config import EngineConfig
from engine.grammar import Grammars
from engine.layers import sampler
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "count": {"type": "integer", "minimum": 0},
                    "tags": {"type": "array", "items": {"enum": ["new", "used", "spare"]}},
                },
                "required": ["name", "count"],
            },
        }
    },
    "required": ["items"],
}
ROUNDS = 3


@dataclass(slots=True)
class GrammarTime:
    """Seconds spent on the grammar in one run, by part, and the run's."""

    masks: float = 0.0
    apply: float = 0.0
    consume: float = 0.0
    run: float = 0.0

    @property
    def total(self) -> float:
        return self.masks + self.apply + self.consume


def main(args: argparse.Namespace, mix: Mix) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = bench_model_dir(args.model, Path(scratch))
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        work = make_workload(
            "random", mix.num_requests, vocab, args.seed, mix.prompt_lens, mix.output_lens
        )
        config = EngineConfig(
            max_num_batched_tokens=args.max_batched_tokens, kv_cache_bytes=1 << 30
        )
        engine = LLMEngine.from_model_dir(model_dir, config)
    schema = json.dumps(SCHEMA)
    # Warm-up, llguidance's tokenizer and the schema's compilation included.
    engine.generate([[7] * 32] * 2, [_greedy(4), _greedy(4, schema)])
    constrained = [_greedy(n, schema if i % 2 == 0 else "") for i, n in enumerate(work.output_lens)]
    best: GrammarTime | None = None
    plain_seconds = float("inf")
    for round_ in range(1, ROUNDS + 1):
        progress(f"round {round_}: half the requests under a JSON schema")
        timing = GrammarTime()
        with _timed(timing):
            timing.run, lengths = _serve(engine, work, constrained)
        best = timing if best is None or timing.run < best.run else best
        progress(f"  {sum(lengths) / timing.run:.1f} tok/s; the same batch, no schema")
        seconds, plain_lengths = _serve(engine, work, [_greedy(n) for n in lengths])
        assert plain_lengths == lengths
        plain_seconds = min(plain_seconds, seconds)
        progress(f"  {sum(lengths) / seconds:.1f} tok/s")
    assert best is not None
    report(args, mix, work, lengths, best, plain_seconds)


def report(
    args: argparse.Namespace,
    mix: Mix,
    work: Workload,
    lengths: list[int],
    mixed: GrammarTime,
    plain_seconds: float,
) -> None:
    """The table and the JSON line: throughputs, their ratio, and the grammar's time per
    constrained token in the faster constrained run."""
    num_constrained = sum(lengths[0::2])
    plain_rate, mixed_rate = sum(lengths) / plain_seconds, sum(lengths) / mixed.run
    parts = {
        part: getattr(mixed, part) / num_constrained * 1e6 for part in ("masks", "apply", "consume")
    }
    per_token_us = mixed.total / num_constrained * 1e6
    print(f"{'batch':<34} {'tok/s':>8}")
    print(f"{'no schema':<34} {plain_rate:>8.1f}")
    print(f"{'half under a JSON schema':<34} {mixed_rate:>8.1f}")
    print(
        f"ratio {mixed_rate / plain_rate:.3f}; grammar {per_token_us:.0f} us per constrained "
        f"token (masks {parts['masks']:.0f}, applying them {parts['apply']:.0f}, matchers "
        f"{parts['consume']:.0f}) = {mixed.total / mixed.run:.1%} of the run, so the ratio "
        f"its work alone allows is {1 - mixed.total / mixed.run:.3f}"
    )
    figures: dict[str, Any] = {
        "model": model_name(args.model),
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "requests": mix.num_requests,
        "output_tokens": sum(lengths),
        "constrained_tokens": num_constrained,
        "constrained_finished_early": sum(
            n < want for n, want in zip(lengths[0::2], work.output_lens[0::2], strict=True)
        ),
        "output_tokens_per_s": {"plain": round(plain_rate, 1), "mixed": round(mixed_rate, 1)},
        "ratio": round(mixed_rate / plain_rate, 3),
        "grammar_us_per_constrained_token": round(per_token_us, 1),
        "grammar_us_parts": {part: round(us, 1) for part, us in parts.items()},
        "grammar_share_of_run": round(mixed.total / mixed.run, 4),
        "ratio_from_grammar_time": round(1 - mixed.total / mixed.run, 3),
    }
    print(json.dumps(figures))


def _greedy(max_tokens: int, schema: str = "") -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, json_schema=schema)


def _serve(
    engine: LLMEngine, work: Workload, params: Sequence[SamplingParams]
) -> tuple[float, list[int]]:
    """Seconds to run the workload's prompts under `params`, all queued at once, and each
    request's number of output tokens."""
    lengths = [0] * len(params)
    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(work.prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths[int(out.request_id)] += len(out.new_token_ids)
    return time.perf_counter() - start, lengths


@contextmanager
def _timed(timing: GrammarTime) -> Iterator[None]:
    """Adds the seconds the engine spends in each part of the grammar's work to `timing`."""
    originals = (decoding.consume, sampler.masked, Grammars.masks)
    decoding.consume = _adding(timing, "consume", decoding.consume)
    sampler.masked = _adding(timing, "apply", sampler.masked)
    Grammars.masks = _adding(timing, "masks", Grammars.masks)  # type: ignore[method-assign]
    try:
        yield
    finally:
        decoding.consume, sampler.masked, Grammars.masks = originals  # type: ignore[method-assign]


def _adding(timing: GrammarTime, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            setattr(timing, part, getattr(timing, part) + time.perf_counter() - start)

    return timed
