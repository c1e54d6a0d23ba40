"""What `bench.stack` prints of a workload run on a baseline (the engine in-process, or an
engine server alone) and through the stack in front of it: tokens/s, TTFT, the ratio and
the added TTFT, and the CPU each process spent."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bench.cpu import BENCH, ENGINE, CpuWindow
from bench.stack_sides import SideResult, StackWorkload, workload_summary

# The services' CPU is everything the stack runs but the engine's steps and this bench.
NOT_SERVICES = (ENGINE, BENCH)
IDLE_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Targets:
    """The stack's throughput at least `throughput` of the baseline's, and its TTFT p50 at
    most `added_ttft_p50_ms` above; printed against the figures, never asserted."""

    throughput: float
    added_ttft_p50_ms: float


def idle_cpu(seconds: float = IDLE_SECONDS) -> CpuWindow:
    """What the stack's processes spend while nothing is asked of them."""
    with CpuWindow() as window:
        time.sleep(seconds)
    return window


def check_tokens(side: SideResult, work: StackWorkload) -> None:
    counts = {t.num_tokens for t in side.timings}
    if counts != {work.max_tokens}:
        raise RuntimeError(f"{side.name}: output lengths {sorted(counts)}, not {work.max_tokens}")


def parts(values: dict[str, float], unit: str) -> str:
    return ", ".join(f"{role} {value:.1f}{unit}" for role, value in values.items())


def report(
    model: str,
    work: StackWorkload,
    base: SideResult,
    stack: SideResult,
    idle: CpuWindow,
    targets: Targets,
    key: str,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """Prints the two sides' table and returns their figures; `key` names the baseline's
    in the JSON (`inprocess`, `llama_server`), `settings` what it ran with."""
    header = f"{'side':<14}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'ttft p50':>10}{'ttft p99':>10}"
    print(f"{header}{'billed p50':>12}{'billed p99':>12}")
    for side in (base, stack):
        billed = (
            f"{side.billed_ms(50):>12.1f}{side.billed_ms(99):>12.1f}"
            if side is stack
            else f"{'-':>12}{'-':>12}"
        )
        print(
            f"{side.name:<14}{side.output_tokens:>8}{side.seconds:>9.2f}"
            f"{side.tokens_per_second:>9.1f}{side.ttft_ms(50):>10.1f}{side.ttft_ms(99):>10.1f}"
            + billed
        )
    ratio = stack.tokens_per_second / base.tokens_per_second
    added_p50 = stack.ttft_ms(50) - base.ttft_ms(50)
    added_p99 = stack.ttft_ms(99) - base.ttft_ms(99)
    print(
        f"stack/{base.name} throughput {ratio:.3f} (target >= {targets.throughput}); "
        f"added TTFT p50 {added_p50:.1f} ms (target <= {targets.added_ttft_p50_ms:.0f}), "
        f"p99 {added_p99:.1f} ms"
    )
    for side in (base, stack):
        print(f"CPU seconds, {side.name}: {side.cpu.describe()}")
    runs = len(stack.timings)
    per_run = stack.cpu.ms_per_run(runs, exclude=NOT_SERVICES)
    idle_percent = idle.percent_of_a_core(exclude=NOT_SERVICES)
    print(
        f"services' CPU per run (all but the engine and this bench, to billed): "
        f"{sum(per_run.values()):.1f} ms ({parts(per_run, 'ms')}); idle: "
        f"{sum(idle_percent.values()):.1f}% of a core ({parts(idle_percent, '%')})"
    )
    print(stored_events_line(stack.events_per_run, work.max_tokens))
    same = sum(a.token_ids == b.token_ids for a, b in zip(base.timings, stack.timings, strict=True))
    return {
        "model": model,
        **workload_summary(work),
        **settings,
        f"{key}_tokens_per_s": round(base.tokens_per_second, 1),
        "stack_tokens_per_s": round(stack.tokens_per_second, 1),
        "throughput_ratio": round(ratio, 3),
        f"{key}_ttft_p50_ms": round(base.ttft_ms(50), 2),
        f"{key}_ttft_p99_ms": round(base.ttft_ms(99), 2),
        "stack_ttft_p50_ms": round(stack.ttft_ms(50), 2),
        "stack_ttft_p99_ms": round(stack.ttft_ms(99), 2),
        "added_ttft_p50_ms": round(added_p50, 2),
        "added_ttft_p99_ms": round(added_p99, 2),
        "stack_billed_p50_ms": round(stack.billed_ms(50), 2),
        "stack_billed_p99_ms": round(stack.billed_ms(99), 2),
        "identical_outputs": same,
        "num_cores": stack.cpu.num_cores,
        f"{key}_cpu_s": base.cpu.rounded(),
        "stack_cpu_s": stack.cpu.rounded(),
        f"{key}_cpu_busy": round(base.cpu.busy_fraction, 3),
        "stack_cpu_busy": round(stack.cpu.busy_fraction, 3),
        "service_cpu_ms_per_run": round(sum(per_run.values()), 2),
        "stored_events_per_run": stack.events_per_run,
        "service_cpu_ms_per_run_by_role": per_run,
        "idle_cpu_percent_of_a_core": round(sum(idle_percent.values()), 2),
        "idle_cpu_percent_by_role": idle_percent,
        "meets_throughput_target": ratio >= targets.throughput,
        "meets_ttft_target": added_p50 <= targets.added_ttft_p50_ms,
    }


def stored_events_line(per_run: float, max_tokens: int) -> str:
    return f"stored events per run: {per_run:.2f} (target <= 4 + tokens / 16 = {4 + max_tokens / 16:g})"


def summary(model: str, reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The figures of several concurrencies' reports in one object; one report alone."""
    if len(reports) == 1:
        return next(iter(reports.values()))
    return {
        "model": model,
        "concurrency": list(reports),
        **{f"throughput_ratio_at_{c}": r["throughput_ratio"] for c, r in reports.items()},
        **{f"added_ttft_p50_ms_at_{c}": r["added_ttft_p50_ms"] for c, r in reports.items()},
        **{
            f"service_cpu_ms_per_run_at_{c}": r["service_cpu_ms_per_run"]
            for c, r in reports.items()
        },
        "idle_cpu_percent_of_a_core": next(iter(reports.values()))["idle_cpu_percent_of_a_core"],
        "by_concurrency": reports,
    }
