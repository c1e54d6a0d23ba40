"""One run over the real stack: one trace across the four processes, and the series its
processes serve at /metrics."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.stack.infra import Endpoints
from tests.e2e.conftest import Stack, running_stack
from tollgate.errors import InvalidArgumentError
from tools.otlp_receiver import ReceivedSpan, TraceReceiver, otlp_receiver

MODEL = "tiny"
SERVICES = {"tollgate-admission", "tollgate-scheduler", "tollgate-worker", "tollgate-ledger"}
GEN_AI_ATTRIBUTES = {
    "gen_ai.operation.name",
    "gen_ai.request.model",
    "gen_ai.request.max_tokens",
    "gen_ai.request.temperature",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.response.finish_reasons",
}
OUR_ATTRIBUTES = {
    "tollgate.run_id",
    "tollgate.tenant_id",
    "tollgate.seq",
    "tollgate.queue_time_seconds",
    "tollgate.ttft_seconds",
}


@pytest.fixture(scope="module")
def traced(
    infra: Endpoints, template_database: str, tiny_model_dir: Path
) -> Iterator[tuple[Stack, TraceReceiver]]:
    with otlp_receiver() as (receiver, endpoint):
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        with running_stack(infra, template_database, tiny_model_dir, env) as (stack, _):
            yield stack, receiver


def _run_trace(receiver: TraceReceiver, run_id: str) -> list[ReceivedSpan]:
    """The spans of the trace(s) holding a span of `run_id`, once the ledger's is there."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        spans = receiver.spans()
        trace_ids = {s.trace_id for s in spans if s.attributes.get("tollgate.run_id") == run_id}
        found = [s for s in spans if s.trace_id in trace_ids]
        if {s.service for s in found} >= SERVICES:
            return found
        time.sleep(0.2)
    raise AssertionError(f"spans of {run_id}: {[(s.service, s.name) for s in found]}")


def test_one_run_is_one_trace_across_the_four_processes(
    traced: tuple[Stack, TraceReceiver],
) -> None:
    stack, receiver = traced
    client = stack.tenant_client("traced")
    events = list(client.generate("trace me", model=MODEL, max_tokens=4, temperature=0.5))
    run_id = events[0].run_id

    spans = _run_trace(receiver, run_id)
    assert len({s.trace_id for s in spans}) == 1
    assert {s.service for s in spans} == SERVICES
    attributes = {key: value for s in spans for key, value in s.attributes.items()}
    assert attributes.keys() >= GEN_AI_ATTRIBUTES | OUR_ATTRIBUTES
    [worker] = [s for s in spans if s.service == "tollgate-worker"]
    assert worker.name == f"text_completion {MODEL}"
    assert worker.attributes["gen_ai.usage.output_tokens"] == 4
    assert worker.attributes["gen_ai.response.finish_reasons"] == ["length"]
    [root] = [s for s in spans if s.service == "tollgate-admission" and s.name.endswith(MODEL)]
    assert root.attributes["gen_ai.request.temperature"] == 0.5
    assert root.attributes["tollgate.run_id"] == run_id


def _scrape(stack: Stack, process: str) -> str:
    url = f"http://127.0.0.1:{stack.metrics[process]}/metrics"
    return str(urllib.request.urlopen(url).read().decode())


def test_each_process_serves_its_series_after_a_run(traced: tuple[Stack, TraceReceiver]) -> None:
    stack, _ = traced
    client = stack.tenant_client("scraped")
    list(client.generate("count me", model=MODEL, max_tokens=4))
    with pytest.raises(InvalidArgumentError):
        list(client.generate("bad", model=MODEL, max_tokens=0))
    expected = {
        "worker": [
            'tollgate_time_to_first_token_seconds_bucket{le="0.005",model_name="tiny",tenant="other"}',
            'tollgate_inter_token_latency_seconds_count{model_name="tiny",tenant="other"}',
            'tollgate_prompt_tokens_total{model_name="tiny",tenant="other"}',
            'tollgate_generation_tokens_total{model_name="tiny",tenant="other"}',
            'tollgate_request_success_total{finished_reason="length",model_name="tiny"',
            'tollgate_prefix_cache_queries_total{model_name="tiny"}',
            'tollgate_prefix_cache_hits_total{model_name="tiny"}',
            'tollgate_num_preemptions_total{model_name="tiny",reason="kv"}',
            "# TYPE tollgate_num_requests_running gauge",
            "# TYPE tollgate_worker_tenant_kv_blocks gauge",
            "# TYPE tollgate_num_requests_suspended gauge",
            'tollgate_kv_cache_usage_perc{model_name="tiny",worker_id=',
            "gen_ai_server_time_to_first_token_seconds_bucket{",
            "gen_ai_server_time_per_output_token_seconds_bucket{",
            "gen_ai_server_request_duration_seconds_bucket{",
            'gen_ai_client_token_usage_bucket{gen_ai_operation_name="text_completion"',
        ],
        "scheduler": [
            "# TYPE tollgate_num_requests_waiting gauge",
            'tollgate_request_queue_time_seconds_count{model_name="tiny",tenant="other"}',
            "tollgate_relay_lag_seconds ",
            "tollgate_consumer_lag_records{",
        ],
        "ledger": [
            'tollgate_ledger_billed_amount_micros_total{currency="USD",model_name="tiny",tenant="other"}',
            "tollgate_ledger_billing_latency_seconds_count ",
            'tollgate_e2e_request_latency_seconds_count{model_name="tiny",tenant="other"}',
            "tollgate_consumer_lag_records{",
        ],
        "admission": [
            'tollgate_rpc_rejections_total{code="INVALID_ARGUMENT",method="Generate",reason=',
        ],
    }
    deadline = time.monotonic() + 20
    missing: dict[str, list[str]] = {}
    while time.monotonic() < deadline:
        pages = {process: _scrape(stack, process) for process in expected}
        missing = {
            process: [series for series in wanted if series not in pages[process]]
            for process, wanted in expected.items()
        }
        if not any(missing.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"series missing: {missing}")
