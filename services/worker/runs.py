"""The runs a worker holds, and the events an engine step turns into (no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from services.core.requeue import ENGINE_ERROR, lost_run_events, prefill_event
from services.core.runs import NewEvent, RunState, StoredEvent

COMPLETED_REASONS = frozenset({"stop", "length", "stop_sequence"})
# OpenAI's stand-in for a log-probability of -inf.
MIN_LOGPROB = -9999.0


@dataclass(slots=True)
class AssignedRun:
    """A run on this worker: where its event stream stands and under which lease."""

    run_id: str
    tenant_id: str
    lease_epoch: int
    last_seq: int
    traceparent: str = ""
    model: str = ""
    # time.monotonic() when it was assigned; its span, open until its end is appended.
    assigned_at: float = 0.0
    span: Span | None = None
    cancel_reason: str | None = None
    # KV blocks held back for the run's whole length (prompt + max_tokens).
    num_kv_blocks: int = 0
    # How many answers it draws (SamplingParams.n).
    num_answers: int = 1
    # Its tenant's weight and class: its share here beside other tenants' runs.
    weight: int = 1
    interactive: bool = True
    # Set while suspended to make room for another tenant's run (services/core/shares.py),
    # with when; how often it was.
    suspended_at: float | None = None
    num_suspensions: int = 0
    # Set once events after `prefill` are stored.
    streamed: bool = False
    # The run's output (tokens, characters) in its stored events, and in all its outputs.
    stored: tuple[int, int] = (0, 0)
    made: tuple[int, int] = (0, 0)
    # Its outputs not stored yet, oldest first, and when the oldest came (loop time).
    pending: list[RequestOutput] = field(default_factory=list)
    pending_since: float = 0.0


def engine_lost_events(
    events: Sequence[StoredEvent], worker_id: str, lease_epoch: int
) -> list[NewEvent]:
    """What settles a run of this worker whose engine died (`lost_run_events`): re-queued
    (or REQUEUE_LIMIT) if it streamed nothing, else `failed` ENGINE_ERROR with the usage
    delivered; nothing for a run that ended meanwhile."""
    message = "the engine process died during the run"
    return lost_run_events(events, ENGINE_ERROR, message, prefill_event(worker_id, lease_epoch))


def usage_of(metrics: RequestMetrics) -> dict[str, Any]:
    return {
        "prompt_tokens": metrics.num_prompt_tokens,
        "cached_prompt_tokens": metrics.num_cached_prompt_tokens,
        "output_tokens": metrics.num_output_tokens,
        "kv_blocks_peak": metrics.kv_blocks_peak,
        "kv_block_seconds": round(metrics.kv_block_seconds, 6),
    }


def step_events(
    run: AssignedRun, outputs: Sequence[RequestOutput], at: tuple[int, int] = (0, 0)
) -> list[NewEvent]:
    """One `streaming` event for the new tokens of a run's consecutive step outputs (with
    n > 1, one per stretch of one answer, naming it, the last of an answer with why it
    ended), then the terminal event if the last of them finished the request. `at` is
    the run's output before them (tokens, characters): each `streaming` payload says
    where its own starts (`services.core.live`).

    Steps that piled up between two of the run's stores become one event instead of
    one each.
    """
    events = []
    tokens, chars = at
    for answer in _answers(outputs):
        token_ids = [token for output in answer for token in output.new_token_ids]
        text = "".join(output.text_delta for output in answer)
        if not token_ids and not text:
            continue
        payload: dict[str, Any] = {"token_ids": token_ids, "text": text, "at": [tokens, chars]}
        tokens, chars = tokens + len(token_ids), chars + len(text)
        for name in ("logprobs", "prompt_logprobs"):
            entries = [logprob_json(e) for output in answer for e in getattr(output, name)]
            if entries:
                payload[name] = entries
        if run.num_answers > 1:
            payload["index"] = answer[0].index
            if answer[-1].finish_reason is not None:
                payload["finish_reason"] = answer[-1].finish_reason
        events.append(NewEvent(RunState.STREAMING, payload))
    if outputs and outputs[-1].finished:
        events.append(terminal_event(run, outputs[-1]))
    return events


def output_end(at: tuple[int, int], outputs: Sequence[RequestOutput]) -> tuple[int, int]:
    """Where a run's output stands (tokens, characters) after `outputs`, from `at`."""
    tokens = sum(len(output.new_token_ids) for output in outputs)
    return at[0] + tokens, at[1] + sum(len(output.text_delta) for output in outputs)


def _answers(outputs: Sequence[RequestOutput]) -> list[list[RequestOutput]]:
    """The outputs in runs of one answer each, one ending where its answer ends."""
    groups: list[list[RequestOutput]] = []
    for output in outputs:
        if groups and groups[-1][-1].index == output.index and not groups[-1][-1].finish_reason:
            groups[-1].append(output)
        else:
            groups.append([output])
    return groups


def logprob_json(entry: TokenLogprob) -> dict[str, Any]:
    """A `TokenLogprob` in its JSON form; a token the format forbids (-inf) at OpenAI's
    floor, since JSON has no infinities."""
    top = [{"token_id": t, "logprob": max(lp, MIN_LOGPROB)} for t, lp in entry.top]
    return {"token_id": entry.token_id, "logprob": max(entry.logprob, MIN_LOGPROB), "top": top}


def terminal_event(run: AssignedRun, output: RequestOutput) -> NewEvent:
    usage = usage_of(output.metrics)
    if output.finish_reason in COMPLETED_REASONS:
        payload: dict[str, Any] = {"finish_reason": output.finish_reason, "usage": usage}
        if output.metrics.ttft is not None:
            payload["ttft_seconds"] = round(output.metrics.ttft, 6)
        return NewEvent(RunState.COMPLETED, payload)
    if output.finish_reason == "abort":
        return NewEvent(
            RunState.CANCELLED, {"reason": run.cancel_reason or "aborted", "usage": usage}
        )
    return NewEvent(
        RunState.FAILED,
        {
            "code": "ENGINE_ERROR",
            "message": output.error or f"finish reason {output.finish_reason}",
            "usage": usage,
        },
    )
