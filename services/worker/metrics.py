"""Prometheus metrics of the worker: what clients feel and what the KV pool holds."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

TTFT = Histogram("tollgate_worker_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS)
ITL = Histogram(
    "tollgate_worker_itl_seconds", "Mean inter-token latency per run", buckets=_LATENCY_BUCKETS
)
QUEUE_TIME = Histogram(
    "tollgate_worker_queue_seconds", "Time in the engine's queue", buckets=_LATENCY_BUCKETS
)
TOKENS = Counter("tollgate_worker_tokens", "Tokens processed", ["kind"])
RUNS = Counter("tollgate_worker_runs_finished", "Runs finished", ["finish_reason"])
ENGINE_RESTARTS = Counter(
    "tollgate_worker_engine_restarts", "Engine processes that died and were replaced"
)
KV_BLOCKS = Gauge("tollgate_worker_kv_blocks", "KV cache blocks", ["state"])


def observe_finished(output: RequestOutput) -> None:
    metrics = output.metrics
    RUNS.labels(output.finish_reason or "unknown").inc()
    TOKENS.labels("prompt").inc(metrics.num_prompt_tokens)
    TOKENS.labels("cached_prompt").inc(metrics.num_cached_prompt_tokens)
    TOKENS.labels("output").inc(metrics.num_output_tokens)
    for histogram, value in (
        (TTFT, metrics.ttft),
        (ITL, metrics.itl_mean),
        (QUEUE_TIME, metrics.queue_time),
    ):
        if value is not None:
            histogram.observe(value)


def observe_pool(num_free: int, num_total: int, num_unreserved: int) -> None:
    KV_BLOCKS.labels("free").set(num_free)
    KV_BLOCKS.labels("used").set(num_total - num_free)
    KV_BLOCKS.labels("unreserved").set(num_unreserved)
