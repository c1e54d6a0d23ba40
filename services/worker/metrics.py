"""Metrics of the worker: what clients feel and what the KV pool holds.

The series a vLLM dashboard reads (`vllm:<name>`) are here as `tollgate_<name>`, with
`model_name` and a bounded `tenant` label (`services/core/metrics.py`); the GenAI
semantic-convention histograms go through the OTel meter, when /metrics is on.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry.metrics import Histogram as OtelHistogram
from opentelemetry.metrics import Meter
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput
from services.core.metrics import TENANTS, meter
from services.worker.runs import AssignedRun

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BY_RUN = ["model_name", "tenant"]

TTFT = Histogram(
    "tollgate_time_to_first_token_seconds",
    "Time from the engine taking a run to its first token",
    _BY_RUN,
    buckets=_LATENCY_BUCKETS,
)
ITL = Histogram(
    "tollgate_inter_token_latency_seconds",
    "Mean gap between consecutive output tokens, one observation per run",
    _BY_RUN,
    buckets=_LATENCY_BUCKETS,
)
QUEUE_TIME = Histogram(
    "tollgate_worker_queue_seconds",
    "Time in the engine's queue",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("tollgate_prompt_tokens", "Prompt tokens of finished runs", _BY_RUN)
GENERATION_TOKENS = Counter("tollgate_generation_tokens", "Output tokens of finished runs", _BY_RUN)
PREFIX_CACHE_QUERIES = Counter(
    "tollgate_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", ["model_name"]
)
PREFIX_CACHE_HITS = Counter(
    "tollgate_prefix_cache_hits", "Prompt tokens found in the prefix cache", ["model_name"]
)
PREEMPTIONS = Counter(
    "tollgate_num_preemptions",
    "Runs preempted, by reason: the engine's blocks ran out (kv), or suspended to make room"
    " for a tenant under its share (share)",
    ["model_name", "reason"],
)
RUNS = Counter(
    "tollgate_request_success",
    "Runs finished on this worker, by the engine's finish reason",
    [*_BY_RUN, "finished_reason"],
)


class RunningRuns(Collector):
    """`tollgate_num_requests_running`, counted at scrape time from the runs held."""

    def __init__(self) -> None:
        self.model = ""
        self.runs: Mapping[str, AssignedRun] = {}

    def watch(self, model: str, runs: Mapping[str, AssignedRun]) -> None:
        self.model, self.runs = model, runs

    def collect(self) -> Iterator[Metric]:
        runs = list(self.runs.values())
        running = [run for run in runs if run.suspended_at is None]
        suspended = [run for run in runs if run.suspended_at is not None]
        held = GaugeMetricFamily(
            "tollgate_num_requests_running", "Runs held by this worker", labels=_BY_RUN
        )
        yield self._by_tenant(held, runs, lambda _: 1)
        blocks = GaugeMetricFamily(
            "tollgate_worker_tenant_kv_blocks",
            "KV blocks held back for each tenant's running runs: its part of this worker",
            labels=_BY_RUN,
        )
        yield self._by_tenant(blocks, running, lambda run: run.num_kv_blocks)
        waiting = GaugeMetricFamily(
            "tollgate_num_requests_suspended",
            "Runs suspended to make room for a tenant under its share, waiting for blocks",
            labels=_BY_RUN,
        )
        yield self._by_tenant(waiting, suspended, lambda _: 1)

    def _by_tenant(
        self,
        family: GaugeMetricFamily,
        runs: list[AssignedRun],
        count: Callable[[AssignedRun], int],
    ) -> GaugeMetricFamily:
        totals: collections.Counter[str] = collections.Counter()
        for run in runs:
            totals[TENANTS.of(run.tenant_id)] += count(run)
        for tenant, total in sorted(totals.items()):
            family.add_metric([self.model, tenant], total)
        return family


RUNNING = RunningRuns()
REGISTRY.register(RUNNING)
KV_USAGE = Gauge(
    "tollgate_kv_cache_usage_perc",
    "Fraction of the KV cache blocks in use (0 to 1)",
    ["model_name", "worker_id"],
)
ENGINE_RESTARTS = Counter(
    "tollgate_worker_engine_restarts", "Engine processes that died and were replaced"
)
KV_BLOCKS = Gauge("tollgate_worker_kv_blocks", "KV cache blocks", ["state"])

# Semantic-convention bucket boundaries (seconds) of the GenAI server metrics.
_TTFT_BOUNDARIES = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)  # fmt: skip
_TPOT_BOUNDARIES = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_DURATION_BOUNDARIES = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)  # fmt: skip
_TOKEN_BOUNDARIES = tuple(float(4**i) for i in range(14))


@dataclass(frozen=True, slots=True)
class GenAiInstruments:
    """gen_ai.server.* and gen_ai.client.token.usage, on the process's OTel meter."""

    ttft: OtelHistogram
    time_per_output_token: OtelHistogram
    request_duration: OtelHistogram
    token_usage: OtelHistogram

    @classmethod
    def on(cls, meter: Meter) -> GenAiInstruments:
        def histogram(
            name: str, unit: str, description: str, bounds: Sequence[float]
        ) -> OtelHistogram:
            return meter.create_histogram(
                name, unit=unit, description=description, explicit_bucket_boundaries_advisory=bounds
            )

        return cls(
            ttft=histogram(
                "gen_ai.server.time_to_first_token",
                "s",
                "Time to generate the first token of a successful request",
                _TTFT_BOUNDARIES,
            ),
            time_per_output_token=histogram(
                "gen_ai.server.time_per_output_token",
                "s",
                "Time per output token after the first, of a successful request",
                _TPOT_BOUNDARIES,
            ),
            request_duration=histogram(
                "gen_ai.server.request.duration",
                "s",
                "Time from the worker taking a request to its end",
                _DURATION_BOUNDARIES,
            ),
            token_usage=histogram(
                "gen_ai.client.token.usage",
                "{token}",
                "Input and output tokens of a request",
                _TOKEN_BOUNDARIES,
            ),
        )


_genai: GenAiInstruments | None = None


def genai() -> GenAiInstruments | None:
    """The GenAI instruments, made on the process's meter once it exists."""
    global _genai
    if _genai is None and (configured := meter()) is not None:
        _genai = GenAiInstruments.on(configured)
    return _genai


def observe_finished(
    output: RequestOutput, model: str, tenant_id: str, duration: float, num_suspensions: int = 0
) -> None:
    """Records a finished run; `duration` is from the engine taking it to its end, and
    `num_suspensions` of its preemptions were for a share (counted when they happened)."""
    metrics = output.metrics
    labels = (model, TENANTS.of(tenant_id))
    RUNS.labels(*labels, output.finish_reason or "unknown").inc()
    PROMPT_TOKENS.labels(*labels).inc(metrics.num_prompt_tokens)
    GENERATION_TOKENS.labels(*labels).inc(metrics.num_output_tokens)
    PREFIX_CACHE_QUERIES.labels(model).inc(metrics.num_prompt_tokens)
    PREFIX_CACHE_HITS.labels(model).inc(metrics.num_cached_prompt_tokens)
    PREEMPTIONS.labels(model, "kv").inc(max(0, metrics.num_preemptions - num_suspensions))
    if metrics.ttft is not None:
        TTFT.labels(*labels).observe(metrics.ttft)
    if metrics.itl_mean is not None:
        ITL.labels(*labels).observe(metrics.itl_mean)
    if metrics.queue_time is not None:
        QUEUE_TIME.labels(model).observe(metrics.queue_time)
    instruments = genai()
    if instruments is not None:
        _observe_genai(instruments, output, model, duration)


def _observe_genai(
    instruments: GenAiInstruments, output: RequestOutput, model: str, duration: float
) -> None:
    metrics = output.metrics
    attributes = {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": model}
    if output.finish_reason not in ("stop", "length", "stop_sequence"):
        attributes = {**attributes, "error.type": output.finish_reason or "unknown"}
    instruments.request_duration.record(duration, attributes)
    for token_type, count in (
        ("input", metrics.num_prompt_tokens),
        ("output", metrics.num_output_tokens),
    ):
        instruments.token_usage.record(count, {**attributes, "gen_ai.token.type": token_type})
    if "error.type" in attributes:
        return  # the two latencies are of successful requests only
    if metrics.ttft is not None:
        instruments.ttft.record(metrics.ttft, attributes)
    if metrics.itl_mean is not None:
        instruments.time_per_output_token.record(metrics.itl_mean, attributes)


def observe_pool(
    model: str, worker_id: str, num_free: int, num_total: int, num_unreserved: int
) -> None:
    KV_BLOCKS.labels("free").set(num_free)
    KV_BLOCKS.labels("used").set(num_total - num_free)
    KV_BLOCKS.labels("unreserved").set(num_unreserved)
    KV_USAGE.labels(model, worker_id).set((num_total - num_free) / num_total if num_total else 0.0)
