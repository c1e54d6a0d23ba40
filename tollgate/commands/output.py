"""How the commands print things: pure functions from SDK values to text or JSON-ready dicts."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tollgate.types import (
    LedgerEntry,
    LimitUsage,
    Reconciliation,
    Run,
    RunEvent,
    Tenant,
    TokenLogprob,
    Usage,
    UsageReport,
)

TEXT_PREVIEW = 40


def money(micros: int, currency: str = "") -> str:
    """Integer micro-units as a decimal with six places, never through a float."""
    sign = "-" if micros < 0 else ""
    whole, fraction = divmod(abs(micros), 1_000_000)
    text = f"{sign}{whole}.{fraction:06d}"
    return f"{text} {currency}" if currency else text


def plain(value: Any) -> Any:
    """A JSON-ready form of SDK values: dataclasses as dicts, times as ISO 8601."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


def event_dict(event: RunEvent) -> dict[str, Any]:
    """An event as a dict without the fields its kind leaves unset."""
    defaults = {f.name: f.default for f in dataclasses.fields(RunEvent)}
    result: dict[str, Any] = {}
    for name, value in plain(event).items():
        keep = name in ("run_id", "seq", "state", "kind") or value != plain(defaults[name])
        if keep and value is not None:
            result[name] = value
    return result


def json_line(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def usage_text(usage: Usage | None) -> str:
    if usage is None:
        return ""
    return (
        f"prompt={usage.prompt_tokens} cached={usage.cached_prompt_tokens}"
        f" output={usage.output_tokens}"
    )


def event_detail(event: RunEvent) -> str:
    """A short description of what the event says, by kind."""
    kind = event.kind
    if kind == "queued":
        detail = f"model={event.model} priority={event.priority}"
        detail += f" prompt_tokens={len(event.prompt_token_ids)}"
        return detail + (f" requeued={event.requeue_reason}" if event.requeue_reason else "")
    if kind == "prefill":
        return f"worker={event.worker_id} cached_prompt_tokens={event.cached_prompt_tokens}"
    if kind == "streaming":
        text = event.text
        shown = text if len(text) <= TEXT_PREVIEW else text[: TEXT_PREVIEW - 1] + "…"
        return f"tokens={len(event.token_ids)} text={json.dumps(shown, ensure_ascii=False)}"
    if kind == "completed":
        return f"finish_reason={event.finish_reason} {usage_text(event.usage)}"
    if kind == "failed":
        return f"code={event.error_code} {usage_text(event.usage)} message={event.error_message!r}"
    if kind == "cancelled":
        return f"reason={event.cancel_reason} {usage_text(event.usage)}"
    if kind == "billed":
        return f"amount={money(event.amount_micros, event.currency)} entries={len(event.entries)}"
    return ""


def event_line(event: RunEvent) -> str:
    return f"{event.run_id} {event.seq} {event.kind} {event_detail(event)}".rstrip()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def logprobs_table(logprobs: Sequence[TokenLogprob]) -> str:
    """One row per token: its id, its log-probability, and the likeliest in its place."""
    rows = [
        (
            x.token_id,
            f"{x.logprob:.4f}",
            " ".join(f"{t.token_id}:{t.logprob:.4f}" for t in x.top) or "-",
        )
        for x in logprobs
    ]
    return table(("TOKEN_ID", "LOGPROB", "TOP"), rows)


def when(value: datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def run_fields(run: Run) -> list[tuple[str, str]]:
    usage = run.usage or Usage()
    return [
        ("run_id", run.run_id),
        ("tenant_id", run.tenant_id),
        ("model", run.model),
        ("state", run.state),
        ("priority", run.priority),
        ("last_seq", str(run.last_seq)),
        ("finish_reason", run.finish_reason or "-"),
        ("prompt_tokens", str(usage.prompt_tokens)),
        ("cached_prompt_tokens", str(usage.cached_prompt_tokens)),
        ("output_tokens", str(usage.output_tokens)),
        ("idempotency_key", run.idempotency_key),
        ("created", when(run.create_time)),
        ("updated", when(run.update_time)),
    ]


def key_values(pairs: Sequence[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in pairs)


def runs_table(runs: Sequence[Run]) -> str:
    rows = [
        (r.run_id, r.state, r.model, (r.usage or Usage()).output_tokens, when(r.create_time))
        for r in runs
    ]
    return table(("RUN_ID", "STATE", "MODEL", "OUTPUT_TOKENS", "CREATED"), rows)


def usage_report(report: UsageReport) -> str:
    head = (
        f"tenant {report.tenant_id or '-'}  runs {report.num_runs}"
        f"  total {money(report.amount_micros, report.currency)}"
    )
    rows = [(x.billing_type, x.quantity, money(x.amount_micros)) for x in report.lines]
    text = head + "\n" + table(("BILLING_TYPE", "QUANTITY", "AMOUNT"), rows)
    if report.limits:
        text += "\n\n" + limits_table(report.limits, report.currency)
    return text


def limits_table(limits: Sequence[LimitUsage], currency: str) -> str:
    """Spend against budget and what is left of each limit."""

    def amount(limit: LimitUsage, value: int) -> object:
        return money(value, currency) if limit.name == "budget_micros" else value

    rows = [
        (
            x.subject,
            f"{x.name} ({x.budget_period})" if x.budget_period else x.name,
            amount(x, x.used),
            amount(x, x.limit),
            amount(x, x.remaining),
            when(x.reset_time) if x.reset_time else "-",
        )
        for x in limits
    ]
    return table(("SUBJECT", "LIMIT", "USED", "OF", "REMAINING", "RESETS"), rows)


def entries_table(entries: Sequence[LedgerEntry]) -> str:
    rows = [
        (
            when(e.create_time),
            e.tenant_id,
            e.run_id,
            e.billing_type,
            e.quantity,
            money(e.unit_price_micros),
            money(e.amount_micros),
        )
        for e in entries
    ]
    headers = ("CREATED", "TENANT_ID", "RUN_ID", "BILLING_TYPE", "QUANTITY", "UNIT_PRICE", "AMOUNT")
    return table(headers, rows)


def reconciliation_text(report: Reconciliation) -> str:
    if report.ok:
        return (
            "ok: every terminal run is billed once and its KV reservation released,"
            " and no run is stuck"
        )
    lines = ["NOT OK"]
    for label, ids in (
        ("unbilled", report.unbilled_run_ids),
        ("unreleased", report.unreleased_run_ids),
        ("mismatched", report.mismatched_run_ids),
        ("stuck", report.stuck_run_ids),
    ):
        lines.extend(f"{label} {run_id}" for run_id in ids)
    return "\n".join(lines)


def tenants_table(tenants: Sequence[Tenant]) -> str:
    rows = []
    for t in tenants:
        quota = t.quota
        kv = quota.max_kv_blocks if quota and quota.max_kv_blocks else "unlimited"
        runs = quota.max_concurrent_runs if quota and quota.max_concurrent_runs else "unlimited"
        rows.append((t.tenant_id, t.name, t.weight, kv, runs))
    return table(("TENANT_ID", "NAME", "WEIGHT", "MAX_KV_BLOCKS", "MAX_CONCURRENT_RUNS"), rows)
