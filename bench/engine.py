"""Offline serving benchmark: the engine against `transformers`, side by side in one process.

    python -m bench.engine            # 64 requests per workload (10 min on 2 cores)
    python -m bench.engine --quick    # 8 shorter requests per workload (1 min)
    python -m bench.engine --adapters 0,1,4   # LoRA adapters in the batch (bench/adapters.py)
    python -m bench.engine --grammar  # half the batch under a JSON schema (bench/grammar.py)

Model (bench/models.py): SmolLM2-135M-Instruct where `tollgate models fetch` has cached
it, else a random ~50M-parameter Llama (hidden 512, intermediate 1408, 8 layers, 8 heads,
4 KV heads, vocab 32000); `--model` picks either. fp32. Workloads, seeded, all requests
arriving at once, greedy, EOS ignored: "random" has prompts of 16-512 random tokens and
16-128 output tokens; "shared-prefix" puts one 384-token prefix before each prompt. Each
runs on the engine, on `transformers` generate() in static batches of 8 with left padding
(a batch runs to its longest output), and on `transformers`' continuous batching
(generate_batch()'s manager). Throughput counts the output tokens requests asked for.
TTFT is from the common arrival; ITL is the gap between consecutive tokens of a request.
The prefix-cache gain is the engine's TTFT p50 on "shared-prefix" without its prefix
cache over with it. The peak fraction is the FLOP rate of the engine's decode-only steps
over the best fp32 matmul rate measured in this run (before the workloads and after
them); the engine in int8 runs the random workload too, and its decode-only steps' rate
(the same count of operations, the weights' multiply-adds integer) is given over its int8
kernel's best rate at 512 rows (`bench.timing.int8_peak_ops`). The matmul floor is the time the random workload's matrix multiplies take at that
rate with nothing else; the throughput ceiling it sets is given as ratios to the
baselines.

On a model with a GGUF file of its own (SmolLM2), and with llama-cpp-python installed
(`pip install -e '.[bench]'`), the engine in fp32 and int8 also runs beside our own loop
over llama.cpp's C API (bench/llama_cpp.py), a profiling aid rather than a baseline: it
is not the server llama.cpp's users run, which `python -m bench.stack --anchor
llama-server` measures against the whole stack. It runs on the F32, Q8_0 and shipped
Q4_1 files, the same threads: the
decode tokens/s of one stream (a 64-token prompt, 128 tokens, best of 3), and the random
workload with all requests at once (llama.cpp continuously batching `--llama-parallel`
sequences, as llama-server does). Table on stdout, progress on stderr, and the last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import hf, llama_cpp
from bench.models import REAL_MODEL, add_model_option, model_name
from bench.models import model_dir as bench_model_dir
from bench.report import counts, progress
from bench.timing import TokenTimes, int8_peak_ops, matmul_peak_flops
from bench.workload import Workload, decode_flops, make_workload, matmul_flops
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model_config
from engine.model_dirs.fetch import fetch_gguf
from engine.model_dirs.registry import KNOWN_MODELS, model_cache, model_index
from engine.sampling import SamplingParams

PREFIX_LEN = 384


@dataclass(frozen=True, slots=True)
class Mix:
    """Request counts and length ranges; shared-prefix prompts are `suffix_lens` tokens
    after the prefix, so that whole prompts stay within 512 tokens."""

    num_requests: int
    prompt_lens: tuple[int, int]
    suffix_lens: tuple[int, int]
    output_lens: tuple[int, int]


FULL = Mix(64, (16, 512), (16, 128), (16, 128))
QUICK = Mix(8, (16, 256), (16, 64), (8, 32))
HF_BATCH_SIZE = 8
ENGINE = "engine"
ENGINE_NO_CACHE = "engine, no prefix cache"
ENGINE_INT8 = "engine int8"
HF_STATIC = f"hf generate(), static batches of {HF_BATCH_SIZE}"
HF_CONTINUOUS = "hf generate_batch(), continuous"


def run_engine(model_dir: Path, work: Workload, config: EngineConfig) -> TokenTimes:
    engine = LLMEngine.from_model_dir(model_dir, config)
    engine.generate([[7] * 32], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    times, _ = serve(engine, work)
    return times


def serve(
    engine: LLMEngine, work: Workload, adapters: Sequence[str] = ()
) -> tuple[TokenTimes, list[list[int]]]:
    """Run the workload greedily, all requests queued at once: timings and output tokens.
    With `adapters`, request i runs under adapters[i % len(adapters)]."""
    result = TokenTimes(start=time.perf_counter(), times=[[] for _ in work.prompts])
    tokens: list[list[int]] = [[] for _ in work.prompts]
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        adapter = adapters[i % len(adapters)] if adapters else ""
        engine.add_request(str(i), prompt, params, adapter=adapter)
    while engine.has_unfinished_requests():
        running = engine.batcher.running
        decode_only = not engine.batcher.waiting and all(
            s.num_uncomputed_tokens == 1 for s in running
        )
        context_sum = sum(s.num_tokens for s in running)
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            result.times[int(out.request_id)].extend([now] * len(out.new_token_ids))
            tokens[int(out.request_id)].extend(out.new_token_ids)
        if decode_only and running:
            result.decode_seconds += now - step_start
            result.decode_tokens += len(outputs)
            result.decode_flops += decode_flops(engine.model_config, len(outputs), context_sum)
    result.end = time.perf_counter()
    if [len(t) for t in tokens] != work.output_lens:
        raise RuntimeError("the engine produced the wrong number of tokens")
    return result, tokens


Rows = dict[str, dict[str, Any] | None]


def run_all(
    model_dir: Path, work: Workload, hf_model: Any, args: argparse.Namespace
) -> tuple[Rows, float]:
    """Every system on one workload: system name -> summary (None where it failed), and
    the FLOP/s of the engine's decode-only steps."""
    config = EngineConfig(max_num_batched_tokens=args.max_batched_tokens, kv_cache_bytes=1 << 30)
    rows: Rows = {}
    progress(f"[{work.name}] engine")
    engine = run_engine(model_dir, work, config)
    rows[ENGINE] = engine.summary(work.num_output_tokens)
    decode_rate = engine.decode_flops / max(engine.decode_seconds, 1e-9)
    if work.name == "shared-prefix":
        progress(f"[{work.name}] engine without prefix cache")
        no_cache = EngineConfig(
            max_num_batched_tokens=args.max_batched_tokens,
            kv_cache_bytes=1 << 30,
            enable_prefix_caching=False,
        )
        rows[ENGINE_NO_CACHE] = run_engine(model_dir, work, no_cache).summary(
            work.num_output_tokens
        )
    if args.skip_baselines or args.skip_transformers:
        return rows, decode_rate
    progress(f"[{work.name}] {HF_STATIC}")
    rows[HF_STATIC] = hf.run_static(hf_model, work, HF_BATCH_SIZE).summary(work.num_output_tokens)
    progress(f"[{work.name}] {HF_CONTINUOUS}")
    rows[HF_CONTINUOUS] = None
    unavailable = hf.continuous_batching_api(hf_model)
    if unavailable:
        print(f"{work.name}: transformers continuous batching unavailable: {unavailable}")
        return rows, decode_rate
    try:
        continuous = hf.run_continuous(hf_model, work, args.max_batched_tokens)
        rows[HF_CONTINUOUS] = continuous.summary(work.num_output_tokens)
    except Exception as exc:  # noqa: BLE001 - any failure of the baseline is reported, not fatal
        print(f"{work.name}: transformers generate_batch() failed: {type(exc).__name__}: {exc}")
    return rows, decode_rate


ANCHOR_VARIANTS = {"engine fp32": None, "engine int8": "int8"}
# Ours against llama.cpp's at the same precision, and our int8 against the shipped 4-bit file.
ANCHOR_RATIOS = {
    "fp32_vs_f32": ("engine fp32", llama_cpp.F32),
    "int8_vs_q8_0": ("engine int8", llama_cpp.Q8_0),
    "int8_vs_q4_1": ("engine int8", llama_cpp.SHIPPED),
}


def run_anchor(name: str, model_dir: Path, work: Workload, args: argparse.Namespace) -> Rows:
    """The engine in fp32 and int8 beside llama.cpp on the model's GGUF files: single-stream
    decode and the workload's throughput, per system (empty when llama.cpp is not here)."""
    reason = llama_cpp.unavailable()
    if reason is None and name not in KNOWN_MODELS:
        reason = f"{name} has no GGUF file of its own (--model {REAL_MODEL} has)"
    if reason is not None:
        print(f"llama.cpp baseline skipped: {reason}")
        return {}
    shipped = fetch_gguf(KNOWN_MODELS[name], model_cache(), index=model_index(), progress=progress)
    single = llama_cpp.single_stream(work.prompts[0])
    rows: Rows = {}
    for label, quantization in ANCHOR_VARIANTS.items():
        progress(f"[{label}] single stream, then {len(work.prompts)} requests")
        config = EngineConfig(
            max_num_batched_tokens=args.max_batched_tokens,
            kv_cache_bytes=1 << 30,
            quantization=quantization,
        )
        engine = LLMEngine.from_model_dir(model_dir, config)
        engine.generate([[7] * 32], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        rate = max(
            llama_cpp.decode_rate(serve(engine, single)[0]) for _ in range(llama_cpp.SINGLE_RUNS)
        )
        rows[label] = {
            "single_stream_decode_tokens_per_s": round(rate, 1),
            **serve(engine, work)[0].summary(work.num_output_tokens),
        }
    theirs = llama_cpp.measure(
        shipped, work, single, threads=torch.get_num_threads(), parallel=args.llama_parallel
    )
    rows.update({f"llama.cpp {kind}": row for kind, row in theirs.items()})
    return rows


def anchor_ratios(rows: Rows) -> dict[str, float | None]:
    figures: dict[str, float | None] = {}
    for name, (ours, theirs) in ANCHOR_RATIOS.items():
        for key, short in (
            ("single_stream_decode_tokens_per_s", "single_stream"),
            ("output_tokens_per_s", "throughput"),
        ):
            figures[f"{short}_{name}"] = _ratio(
                _figure(rows, ours, key), _figure(rows, f"llama.cpp {theirs}", key)
            )
    return figures


def print_anchor(rows: Rows, parallel: int) -> None:
    print(f"{'system':<20} {'1 stream decode tok/s':>22} {'random workload tok/s':>22} "
          f"{'TTFT p50':>9}   (llama.cpp's C API in our loop, {parallel} parallel sequences;"
          " not llama-server: see bench.stack --anchor llama-server)")  # fmt: skip
    for system, row in rows.items():
        assert row is not None
        print(
            f"{system:<20} {row['single_stream_decode_tokens_per_s']:>22.1f} "
            f"{row['output_tokens_per_s']:>22.1f} {row['ttft_p50_s']:>8.3f}s"
        )


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 2)


def _figure(rows: Rows, system: str, key: str = "output_tokens_per_s") -> float | None:
    row = rows.get(system)
    return None if row is None else float(row[key])


def print_table(results: dict[str, Rows]) -> None:
    header = (
        f"{'workload':<14} {'system':<36} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8}"
    )
    print(header)
    print("-" * len(header))
    for workload, rows in results.items():
        for system, row in rows.items():
            if row is None:
                print(f"{workload:<14} {system:<36} {'failed':>8}")
                continue
            print(
                f"{workload:<14} {system:<36} {row['output_tokens_per_s']:>8.1f} "
                f"{row['ttft_p50_s']:>8.3f}s {row['ttft_p99_s']:>8.3f}s "
                f"{row['itl_p50_ms']:>6.1f}ms {row['itl_p99_ms']:>6.1f}ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="8 short requests per workload")
    add_model_option(parser)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-baselines", action="store_true")
    parser.add_argument(
        "--skip-transformers",
        action="store_true",
        help="leave out the transformers baselines (the slowest part); llama.cpp's stays",
    )
    parser.add_argument(
        "--llama-parallel",
        type=int,
        default=16,
        help="llama.cpp's parallel sequences for the workload (default 16, as llama-server -np)",
    )
    parser.add_argument(
        "--grammar",
        action="store_true",
        help="instead: the random workload with half its requests under a JSON schema",
    )
    parser.add_argument(
        "--adapters",
        type=counts,
        default=None,
        metavar="N,N,...",
        help="instead: the random workload with N LoRA adapters in the batch, for each N",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    mix = QUICK if args.quick else FULL
    if args.grammar:
        from bench.grammar import main as grammar_main

        grammar_main(args, mix)
        return
    if args.adapters is not None:
        from bench.adapters import main as adapters_main

        adapters_main(args, mix)
        return
    with tempfile.TemporaryDirectory() as scratch:
        name = model_name(args.model)
        model_dir = bench_model_dir(name, Path(scratch))
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        workloads = [
            make_workload(
                "random", mix.num_requests, vocab, args.seed, mix.prompt_lens, mix.output_lens
            ),
            make_workload(
                "shared-prefix",
                mix.num_requests,
                vocab,
                args.seed + 1,
                mix.suffix_lens,
                mix.output_lens,
                prefix_len=PREFIX_LEN,
            ),
        ]
        progress("measuring the matmul peaks (fp32, and the int8 kernel's)")
        peak, int8_peak = matmul_peak_flops(), int8_peak_ops()
        skip_hf = args.skip_baselines or args.skip_transformers
        hf_model = None if skip_hf else hf.load_hf_model(model_dir)
        random_rows, decode_rate = run_all(model_dir, workloads[0], hf_model, args)
        progress(f"[{workloads[0].name}] {ENGINE_INT8}")
        int8_config = EngineConfig(
            max_num_batched_tokens=args.max_batched_tokens,
            kv_cache_bytes=1 << 30,
            quantization="int8",
        )
        int8 = run_engine(model_dir, workloads[0], int8_config)
        random_rows[ENGINE_INT8] = int8.summary(workloads[0].num_output_tokens)
        int8_rate = int8.decode_flops / max(int8.decode_seconds, 1e-9)
        shared_rows, _ = run_all(model_dir, workloads[1], hf_model, args)
        anchor_rows = {} if args.skip_baselines else run_anchor(name, model_dir, workloads[0], args)
        # A busy moment on a shared machine hides the peak: measured again at the end,
        # the better of the two counts.
        progress("measuring the matmul peaks again")
        peak, int8_peak = max(peak, matmul_peak_flops()), max(int8_peak, int8_peak_ops())
        floor = matmul_flops(load_model_config(model_dir), workloads[0]) / peak
    results = {"random": random_rows, "shared-prefix": shared_rows}
    print_table(results)
    if anchor_rows:
        print_anchor(anchor_rows, args.llama_parallel)
    engine_rate = _figure(random_rows, ENGINE)
    ceiling = workloads[0].num_output_tokens / floor
    figures = {
        "model": name,
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "requests": mix.num_requests,
        "output_tokens": {work.name: work.num_output_tokens for work in workloads},
        "results": results,
        "throughput_vs_hf_static": _ratio(engine_rate, _figure(random_rows, HF_STATIC)),
        "throughput_vs_hf_batch": _ratio(engine_rate, _figure(random_rows, HF_CONTINUOUS)),
        "shared_prefix_vs_hf_static": _ratio(
            _figure(shared_rows, ENGINE), _figure(shared_rows, HF_STATIC)
        ),
        "shared_prefix_vs_hf_batch": _ratio(
            _figure(shared_rows, ENGINE), _figure(shared_rows, HF_CONTINUOUS)
        ),
        "prefix_ttft_gain": _ratio(
            _figure(shared_rows, ENGINE_NO_CACHE, "ttft_p50_s"),
            _figure(shared_rows, ENGINE, "ttft_p50_s"),
        ),
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "decode_gflops": round(decode_rate / 1e9, 1),
        "peak_fraction": round(decode_rate / peak, 3),
        "int8_peak_gops": round(int8_peak / 1e9, 1),
        "int8_decode_gops": round(int8_rate / 1e9, 1),
        "int8_peak_fraction": round(int8_rate / int8_peak, 3),
        "matmul_floor_s": round(floor, 2),
        "ceiling_vs_hf_static": _ratio(ceiling, _figure(random_rows, HF_STATIC)),
        "ceiling_vs_hf_batch": _ratio(ceiling, _figure(random_rows, HF_CONTINUOUS)),
        "llama_cpp": {
            "parallel": args.llama_parallel,
            "results": anchor_rows,
            **anchor_ratios(anchor_rows),
        }
        if anchor_rows
        else None,
    }
    if figures["throughput_vs_hf_static"] is not None:
        print(
            f"engine vs hf static: {figures['throughput_vs_hf_static']}x, "
            f"vs hf continuous: {figures['throughput_vs_hf_batch']}x (random workload)"
        )
    print(
        f"prefix-cache TTFT p50 gain: {figures['prefix_ttft_gain']}x; "
        f"decode {figures['decode_gflops']} GFLOP/s = {figures['peak_fraction']:.1%} "
        f"of the {figures['matmul_peak_gflops']} GFLOP/s matmul peak"
    )
    print(
        f"int8 decode {figures['int8_decode_gops']} G integer ops/s = "
        f"{figures['int8_peak_fraction']:.1%} of the int8 kernel's "
        f"{figures['int8_peak_gops']} G ops/s at 512 rows"
    )
    baselines = (
        f" = {figures['ceiling_vs_hf_static']}x / {figures['ceiling_vs_hf_batch']}x the baselines"
        if figures["ceiling_vs_hf_static"] is not None
        else ""
    )
    print(
        f"random workload, its matrix multiplies alone at that peak: {floor:.2f} s, so at "
        f"most {ceiling:.0f} tok/s{baselines}; the engine took "
        f"{_figure(random_rows, ENGINE, 'seconds')} s"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
