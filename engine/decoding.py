"""What the engine keeps of a request between its steps (pure Python): its sequence, the
state that turns each new token into text and decides when the request ends, and the
answers of a request that asks for several (n > 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance
import torch

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.grammar import consume
from engine.outputs import RequestMetrics, TokenLogprob, combined, metrics_of
from engine.sequence import Sequence


@dataclass(slots=True)
class PreparedRequest:
    """A validated request: its sequence and the decoding state kept until it finishes."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    stop_token_ids: frozenset[int]
    generator: torch.Generator
    # Where the request's output stands in its grammar; None without one.
    matcher: llguidance.LLMatcher | None = None
    # Which of its request's answers this is, and the request's answers when n > 1.
    index: int = 0
    group: AnswerGroup | None = None
    # The prompt's logprobs so far, from its second token on, when the request asked.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def score(self, first: int, entries: list[TokenLogprob]) -> None:
        """Takes the logprobs of the prompt tokens from position `first + 1` on; those
        already taken (a prompt computed again after a preemption) are skipped."""
        have = len(self.prompt_logprobs)
        if first <= have:
            self.prompt_logprobs.extend(entries[have - first :])

    def advance(self, token: int, max_model_len: int) -> tuple[str, str | None]:
        """Takes the token just appended to the sequence: the text it adds, and the
        finish reason when it ends the request."""
        seq = self.seq
        reason: str | None = None
        text = ""
        if token in self.stop_token_ids:
            reason = "stop"
        else:
            text, matched = self.stops.feed(self.detokenizer.push(token))
            reason = "stop_sequence" if matched else None
        # Once the grammar allows nothing more the output is complete, as at an EOS.
        if reason is None and self.matcher is not None and consume(self.matcher, token):
            reason = "stop"
        if reason is None and (
            seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len
        ):
            reason = "length"
        if reason in ("stop", "length"):
            text += self.stops.flush()
        return text, reason


@dataclass(slots=True)
class AnswerGroup:
    """The answers of one request with n > 1, each its own sequence under an id of its own.

    The first computes the prompt; the others wait until it has (its first token), so
    that they find the prompt's full blocks in the prefix cache and compute only its last
    partial block. The request ends when its last answer does.
    """

    request_id: str
    answers: list[PreparedRequest]
    waiting: list[PreparedRequest] = field(default_factory=list)
    num_ended: int = 0

    @property
    def ended(self) -> bool:
        return self.num_ended == len(self.answers)

    def metrics(self) -> RequestMetrics:
        return combined([metrics_of(answer.seq) for answer in self.answers])


def answer_id(request_id: str, index: int) -> str:
    """The sequence id of a request's answer: the request's own for the first."""
    return request_id if index == 0 else f"{request_id}\x00{index}"
