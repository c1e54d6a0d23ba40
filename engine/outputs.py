"""What the engine hands back after each step (frozen values, safe to pass across threads)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence

FINISH_REASONS = ("stop", "length", "stop_sequence", "abort")


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Timings in seconds of the engine's clock; None until the event has happened.

    `itl_mean` / `itl_max` are the gaps between consecutive output tokens.
    `kv_block_seconds` integrates the KV blocks held over time.
    """

    arrival_time: float
    queue_time: float | None
    ttft: float | None
    itl_mean: float | None
    itl_max: float | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_output_tokens: int
    kv_blocks_peak: int
    kv_block_seconds: float
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The progress of one request in one step.

    `new_token_ids` includes a final EOS / stop token; `text_delta` never contains it,
    nor a matched stop string, nor a partial UTF-8 character.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics


def metrics_of(seq: Sequence) -> RequestMetrics:
    num_gaps = seq.num_output_tokens - 1
    return RequestMetrics(
        arrival_time=seq.arrival_time,
        queue_time=_since(seq.arrival_time, seq.first_scheduled_time),
        ttft=_since(seq.arrival_time, seq.first_token_time),
        itl_mean=seq.itl_sum / num_gaps if num_gaps > 0 else None,
        itl_max=seq.itl_max if num_gaps > 0 else None,
        num_prompt_tokens=seq.num_prompt_tokens,
        num_cached_prompt_tokens=seq.num_cached_tokens or 0,
        num_output_tokens=seq.num_output_tokens,
        kv_blocks_peak=seq.kv_blocks_peak,
        kv_block_seconds=seq.kv_block_seconds,
        num_preemptions=seq.num_preemptions,
    )


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else end - start


@dataclass(frozen=True, slots=True)
class Completion:
    """The whole result of one finished request."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    metrics: RequestMetrics
