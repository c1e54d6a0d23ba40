"""Generates the Grafana dashboard deploy/grafana/dashboards/tollgate.json (`make dashboard`).

Every query is built from `METRICS`: to follow a renamed series, change its name there and
regenerate. A role with several names is queried as `first or second …`: the first name that
has series wins, so the dashboard reads the vLLM-style names and, where a process does not
serve them yet, the per-process names that predate them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "deploy" / "grafana" / "dashboards" / "tollgate.json"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}

# role -> exposed series names, preferred first (histograms without `_bucket`, counters
# with `_total`). A name with `{…}` carries the label selector it needs.
METRICS: dict[str, tuple[str, ...]] = {
    "ttft": ("tollgate_time_to_first_token_seconds",),
    "itl": ("tollgate_inter_token_latency_seconds",),
    "engine_queue": ("tollgate_worker_queue_seconds",),
    "scheduler_queue": ("tollgate_request_queue_time_seconds",),
    "e2e": ("tollgate_e2e_request_latency_seconds",),
    "running": ("tollgate_num_requests_running",),
    "waiting": ("tollgate_num_requests_waiting",),
    "kv_usage": ("tollgate_kv_cache_usage_perc",),
    "kv_blocks": ("tollgate_worker_kv_blocks",),
    "prompt_tokens": ("tollgate_prompt_tokens_total",),
    "generation_tokens": ("tollgate_generation_tokens_total",),
    "finished": ("tollgate_request_success_total",),
    "rejections": ("tollgate_rpc_rejections_total",),
    "workers": ("tollgate_scheduler_workers",),
    "spend": ("tollgate_ledger_billed_amount_micros_total",),
    "relay_lag": ("tollgate_relay_lag_seconds",),
    "consumer_lag": ("tollgate_consumer_lag_records",),
    "published": ("tollgate_relay_events_published_total",),
}

RATE = "[$__rate_interval]"


def alternatives(role: str, template: str) -> str:
    """`template` with `{m}` replaced by each of the role's names, joined by `or`."""
    return " or ".join(template.format(m=name) for name in METRICS[role])


def quantile(role: str, q: float) -> str:
    return alternatives(role, f"histogram_quantile({q}, sum by (le) (rate({{m}}_bucket{RATE})))")


@dataclass(frozen=True, slots=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    unit: str
    targets: tuple[Target, ...]
    description: str = ""


def latency(title: str, role: str) -> Panel:
    return Panel(
        title,
        "s",
        tuple(Target(quantile(role, q), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)),
        f"Quantiles of {' / '.join(METRICS[role])}.",
    )


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Latency",
        (
            latency("Time to first token", "ttft"),
            latency("Inter-token latency", "itl"),
            Panel(
                "Queue time",
                "s",
                (
                    Target(quantile("scheduler_queue", 0.5), "scheduler p50"),
                    Target(quantile("scheduler_queue", 0.99), "scheduler p99"),
                    Target(quantile("engine_queue", 0.5), "engine p50"),
                    Target(quantile("engine_queue", 0.99), "engine p99"),
                ),
                "Queued event to assignment (scheduler), then in the engine's own queue.",
            ),
            latency("End-to-end latency", "e2e"),
        ),
    ),
    (
        "Load",
        (
            Panel(
                "Runs running and waiting",
                "short",
                (
                    Target(alternatives("running", "sum({m})"), "running"),
                    Target(alternatives("waiting", "sum({m})"), "waiting"),
                    Target(alternatives("workers", "max({m})"), "live workers"),
                ),
            ),
            Panel(
                "KV cache usage per worker",
                "percentunit",
                (
                    Target(
                        alternatives("kv_usage", "max by (instance) ({m})")
                        + " or "
                        + alternatives(
                            "kv_blocks",
                            'sum by (instance) ({m}{{state="used"}})'
                            ' / sum by (instance) ({m}{{state=~"used|free"}})',
                        ),
                        "{{instance}}",
                    ),
                ),
                "Fraction of each worker's KV blocks in use.",
            ),
            Panel(
                "Tokens per second",
                "short",
                (
                    Target(alternatives("prompt_tokens", f"sum(rate({{m}}{RATE}))"), "prompt"),
                    Target(
                        alternatives("generation_tokens", f"sum(rate({{m}}{RATE}))"), "generation"
                    ),
                ),
            ),
            Panel(
                "Runs finished and calls refused per second",
                "reqps",
                (
                    Target(
                        alternatives("finished", f"sum by (finish_reason) (rate({{m}}{RATE}))"),
                        "{{finish_reason}}",
                    ),
                    Target(
                        alternatives("rejections", f"sum by (code) (rate({{m}}{RATE}))"),
                        "refused {{code}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Spend and lag",
        (
            Panel(
                "Spend per hour",
                "short",
                (
                    Target(
                        alternatives(
                            "spend", f"sum by (currency) (rate({{m}}{RATE})) * 3600 / 1e6"
                        ),
                        "{{currency}}",
                    ),
                ),
                "Billed amount per hour in currency units (the ledger counts micro-units).",
            ),
            Panel(
                "Relay lag",
                "s",
                (
                    Target(alternatives("relay_lag", "max by (job) ({m})"), "{{job}}"),
                    Target(
                        alternatives("published", f"sum by (job) (rate({{m}}{RATE}))"),
                        "published/s {{job}}",
                    ),
                ),
                "Age of the oldest event not yet on Kafka, per process running a relay.",
            ),
            Panel(
                "Consumer lag",
                "short",
                (Target(alternatives("consumer_lag", "sum by (group) ({m})"), "{{group}}"),),
                "Records on the run-event topic each consumer group has yet to read.",
            ),
        ),
    ),
)


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 6, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend, "refId": ref}
            for t, ref in zip(panel.targets, "ABCDEFGH", strict=False)
        ],
    }


def layout() -> Iterator[dict[str, Any]]:
    """Each row a row panel (open), then its panels four to a line."""
    panel_id, y = 1, 0
    for title, panels in ROWS:
        yield {
            "id": panel_id,
            "type": "row",
            "title": title,
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            "panels": [],
        }
        panel_id, y = panel_id + 1, y + 1
        for index, panel in enumerate(panels):
            yield panel_json(panel, panel_id, (index % 4) * 6, y + (index // 4) * 8)
            panel_id += 1
        y += ((len(panels) + 3) // 4) * 8


def dashboard() -> dict[str, Any]:
    return {
        "uid": "tollgate",
        "title": "Tollgate",
        "tags": ["tollgate"],
        "editable": True,
        "schemaVersion": 39,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": {"list": []},
        "panels": list(layout()),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def queried_metrics() -> set[str]:
    """Every series name a panel queries, selectors dropped."""
    return {name.partition("{")[0] for names in METRICS.values() for name in names}


def main() -> None:
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
