"""Running prompts to completion on an engine, for scripts, benches and tests."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from engine.outputs import Completion, RequestOutput, TokenLogprob
from engine.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine, Prompt

_ids = itertools.count()


def generate(
    engine: LLMEngine,
    prompts: Seq[Prompt],
    params: SamplingParams | Seq[SamplingParams] | None = None,
) -> list[Completion]:
    """Runs `prompts` on `engine` to completion (with whatever else it has queued); the
    results in prompt order."""
    per_prompt = (
        list(params) if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
    )
    ids = [f"generate-{next(_ids)}-{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, per_prompt, strict=True):
        engine.add_request(request_id, prompt, p)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    texts: dict[str, list[str]] = {i: [] for i in ids}
    logprobs: dict[str, list[TokenLogprob]] = {i: [] for i in ids}
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
    done: dict[str, RequestOutput] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.text_delta)
                logprobs[out.request_id].extend(out.logprobs)
                if out.prompt_logprobs:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    done[out.request_id] = out
    return [
        Completion(
            i,
            tuple(tokens[i]),
            "".join(texts[i]),
            done[i].finish_reason or "",
            done[i].metrics,
            tuple(logprobs[i]),
            prompt_logprobs.get(i, ()),
        )
        for i in ids
    ]
