"""What the engine hands back after each step (frozen values, safe to pass across threads)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence

FINISH_REASONS = ("stop", "length", "stop_sequence", "abort", "error")


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
class TokenLogprob:
    """One output token's log-probability and the `k` likeliest tokens' (token id,
    log-probability), likeliest first, as the request's `logprobs` asked (SamplingParams
    says which distribution they come from)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """The progress of one request in one step.

    `new_token_ids` includes a final EOS / stop token; `text_delta` never contains it,
    nor a matched stop string, nor a partial UTF-8 character.
    With n > 1 each output is one answer's (`index`); `finish_reason` says why that answer
    ended, and `finished` comes with the last answer's end. `metrics` are the request's,
    all its answers together.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    # Why the request failed, for finish reason "error" (an engine server's answer).
    error: str = ""
    # One per new token when the request asked for logprobs; empty otherwise.
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0
    # With the first token of the request (its first answer's), when it asked for
    # prompt_logprobs: one per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class Progress:
    """A request's metrics reckoned from its tokens as they arrive (monotonic seconds),
    for engines that keep none themselves (an engine server, the simulated engine): its
    KV blocks are its prompt and output so far in blocks of `block_size`, held from its
    arrival to its end."""

    num_prompt_tokens: int
    block_size: int
    arrival: float
    num_cached: int = 0
    num_output: int = 0
    first_token: float | None = None
    last_token: float | None = None
    itl_sum: float = 0.0
    itl_max: float = 0.0
    # KV blocks held since `held_since`, and what they add up to before it.
    held_since: float = 0.0
    kv_block_seconds: float = 0.0
    kv_blocks_peak: int = 0

    def blocks(self) -> int:
        return -(-(self.num_prompt_tokens + self.num_output) // self.block_size)

    def advance(self, now: float, num_new: int) -> None:
        self.kv_block_seconds += self.blocks() * (now - self.held_since)
        self.held_since = now
        if num_new:
            if self.last_token is not None:
                gap = now - self.last_token
                self.itl_sum += gap
                self.itl_max = max(self.itl_max, gap)
            self.first_token = self.first_token if self.first_token is not None else now
            self.last_token = now
            self.num_output += num_new
        self.kv_blocks_peak = max(self.kv_blocks_peak, self.blocks())

    def output(
        self,
        now: float,
        request_id: str,
        token_ids: tuple[int, ...] = (),
        text: str = "",
        finish_reason: str | None = None,
        error: str = "",
    ) -> RequestOutput:
        """The request's output for the tokens that arrived at `now`."""
        self.advance(now, len(token_ids))
        return RequestOutput(
            request_id=request_id,
            new_token_ids=token_ids,
            text_delta=text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            metrics=self.metrics(),
            error=error,
        )

    def metrics(self) -> RequestMetrics:
        gaps = self.num_output - 1
        return RequestMetrics(
            arrival_time=self.arrival,
            queue_time=None,
            ttft=None if self.first_token is None else self.first_token - self.arrival,
            itl_mean=self.itl_sum / gaps if gaps > 0 else None,
            itl_max=self.itl_max if gaps > 0 else None,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_prompt_tokens=self.num_cached,
            num_output_tokens=self.num_output,
            kv_blocks_peak=self.kv_blocks_peak,
            kv_block_seconds=self.kv_block_seconds,
            num_preemptions=0,
        )


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


def combined(answers: list[RequestMetrics]) -> RequestMetrics:
    """One request's metrics from its answers' (the first computed the prompt): their
    output, KV and preemptions added up, the prompt and the timings the first's."""
    first = answers[0]
    return RequestMetrics(
        arrival_time=first.arrival_time,
        queue_time=first.queue_time,
        ttft=first.ttft,
        itl_mean=first.itl_mean,
        itl_max=first.itl_max,
        num_prompt_tokens=first.num_prompt_tokens,
        num_cached_prompt_tokens=first.num_cached_prompt_tokens,
        num_output_tokens=sum(m.num_output_tokens for m in answers),
        kv_blocks_peak=sum(m.kv_blocks_peak for m in answers),
        kv_block_seconds=sum(m.kv_block_seconds for m in answers),
        num_preemptions=sum(m.num_preemptions for m in answers),
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
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
