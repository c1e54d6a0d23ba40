"""The anchor's workload on the engine alone, in-process: what `bench.stack --anchor
llama-server` asks of the whole stack, without the services.

    python -m bench.closed_loop [--quantization int8] [--kv-dtype bfloat16] [--streams 16]

SmolLM2-135M-Instruct (or `--model`), `--streams` requests at a time, each of
`PROMPT_TOKENS` random tokens and `MAX_TOKENS` greedy output tokens with `ignore_eos`; as
one ends the next is added, until `--requests` have run. Reports output tokens/s and the
engine's steps in two kinds: decode-only steps (every sequence adds one token: one native
call) and mixed ones (a prompt chunk among them), with their count and mean time. The
stack's figure at the same streams over this one is the share of the engine the services
leave it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from bench.models import add_model_option
from bench.models import model_dir as bench_model_dir
from bench.stack_anchor import MAX_TOKENS, PROMPT_TOKENS
from engine.config import KV_DTYPES, QUANTIZATIONS, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_option(parser)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None)
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    args = parser.parse_args()
    if args.streams < 1 or args.requests < args.streams:
        parser.error("--streams must be positive and --requests at least --streams")
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = bench_model_dir(args.model, Path(scratch))
        config = EngineConfig(
            max_num_batched_tokens=args.max_batched_tokens,
            kv_cache_bytes=1 << 30,
            quantization=args.quantization,
            kv_dtype=args.kv_dtype,
        )
        engine = LLMEngine.from_model_dir(model_dir, config)
        figures: dict[str, float | str] = dict(run(engine, args.streams, args.requests))
    figures |= {"quantization": args.quantization or "none", "kv_dtype": args.kv_dtype}
    for kind in ("decode", "mixed"):
        print(
            f"{kind:>7} steps: {figures[f'{kind}_steps']:>5}, {figures[f'{kind}_ms']:.1f} ms each"
        )
    print(f"{figures['tokens_per_s']:.1f} output tokens/s, {args.streams} streams")
    print(json.dumps(figures))


def run(engine: LLMEngine, streams: int, requests: int) -> dict[str, float]:
    engine.generate([[7] * 32], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    added = 0

    def add() -> None:
        nonlocal added
        prompt = [rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS)]
        engine.add_request(str(added), prompt, params)
        added += 1

    for _ in range(streams):
        add()
    steps = {"decode": [0, 0.0], "mixed": [0, 0.0]}
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        running = engine.batcher.running
        decode_only = not engine.batcher.waiting and all(
            s.num_uncomputed_tokens == 1 for s in running
        )
        step_start = time.perf_counter()
        outputs = engine.step()
        kind = steps["decode" if decode_only else "mixed"]
        kind[0] += 1
        kind[1] += time.perf_counter() - step_start
        for out in outputs:
            tokens += len(out.new_token_ids)
            if out.finished and added < requests:
                add()
    elapsed = time.perf_counter() - start
    figures: dict[str, float] = {"tokens_per_s": round(tokens / elapsed, 1), "streams": streams}
    for name, (count, seconds) in steps.items():
        figures[f"{name}_steps"] = count
        figures[f"{name}_ms"] = round(1000 * seconds / max(count, 1), 1)
    return figures


if __name__ == "__main__":
    main()
