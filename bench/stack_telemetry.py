"""`bench.stack --telemetry`: the same workload through a stack with metrics and tracing off,
then through one with both on (every process's /metrics served, every span exported over
OTLP/gRPC to a receiver in this process), in one run: the throughput ratio and the TTFT
p50 the telemetry adds.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from bench.report import progress
from bench.stack_sides import (
    SideResult,
    StackWorkload,
    run_stack,
    running_stack,
    workload_summary,
)
from tools.otlp_receiver import otlp_receiver

THROUGHPUT_TARGET = 0.97
OFF_ENV = {"TOLLGATE_METRICS_LISTEN": "", "OTEL_TRACES_EXPORTER": "none"}


def run_side(
    name: str,
    scratch: Path,
    model_dir: Path,
    args: argparse.Namespace,
    work: StackWorkload,
    env: dict[str, str],
) -> SideResult:
    log_dir = (args.logs or scratch / "logs") / name
    progress(f"telemetry {name}: starting the stack (logs in {log_dir})")
    with running_stack(scratch / name, model_dir, args, log_dir, env) as running:
        side = asyncio.run(
            asyncio.wait_for(run_stack(running.gateway, running.api_key, work), args.timeout)
        )
    progress(f"telemetry {name}: {side.tokens_per_second:,.1f} output tokens/s")
    return side


def bench_telemetry(
    args: argparse.Namespace, scratch: Path, model_dir: Path, work: StackWorkload
) -> dict[str, Any]:
    off = run_side("off", scratch, model_dir, args, work, OFF_ENV)
    with otlp_receiver() as (receiver, endpoint):
        on_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_EXPORTER": "otlp"}
        on = run_side("on", scratch, model_dir, args, work, on_env)
        num_spans = len(receiver.spans())
    ratio = on.tokens_per_second / off.tokens_per_second
    added_p50 = on.ttft_ms(50) - off.ttft_ms(50)
    print(f"{'side':<6}{'tok/s':>9}{'ttft p50':>10}{'ttft p99':>10}")
    for side, label in ((off, "off"), (on, "on")):
        print(
            f"{label:<6}{side.tokens_per_second:>9.1f}{side.ttft_ms(50):>10.1f}"
            f"{side.ttft_ms(99):>10.1f}"
        )
    print(f"throughput ratio {ratio:.3f}, added TTFT p50 {added_p50:+.1f} ms, {num_spans} spans")
    for side, label in ((off, "off"), (on, "on")):
        print(f"CPU seconds, telemetry {label}: {side.cpu.describe()}")
    return {
        "mode": "telemetry",
        **workload_summary(work),
        "off_tokens_per_s": round(off.tokens_per_second, 1),
        "on_tokens_per_s": round(on.tokens_per_second, 1),
        "throughput_ratio": round(ratio, 3),
        "off_ttft_p50_ms": round(off.ttft_ms(50), 2),
        "on_ttft_p50_ms": round(on.ttft_ms(50), 2),
        "added_ttft_p50_ms": round(added_p50, 2),
        "spans_exported": num_spans,
        "off_cpu_s": off.cpu.rounded(),
        "on_cpu_s": on.cpu.rounded(),
        "meets_throughput_target": ratio >= THROUGHPUT_TARGET,
    }
