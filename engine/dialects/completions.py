"""OpenAI's completions API (`/v1/completions`), and vLLM's, which extends it: the bodies a
run becomes and `CompletionsReader`, which reads both kinds' chunks."""

from __future__ import annotations

from typing import Any

from engine.dialects import wire
from engine.dialects.refusals import refuse_unsendable
from engine.dialects.wire import Delta, MalformedChunk, Reader, Request, cache_salt
from engine.outputs import TokenLogprob
from engine.sampling import SamplingParams


def _openai_sampling(params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": 0.0 if params.is_greedy else params.temperature,
        "top_p": params.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    return {**body, **wire.penalties(params)}


def _completions_body(request: Request) -> dict[str, Any]:
    return {
        "model": request.adapter or request.model,
        "prompt": list(request.prompt),
        **_openai_sampling(request.params),
    }


def openai_body(request: Request) -> dict[str, Any]:
    refuse_unsendable("openai", request.params)
    return _completions_body(request)


def vllm_body(request: Request) -> dict[str, Any]:
    params = request.params
    body = _completions_body(request)
    body["return_token_ids"] = True
    body["skip_special_tokens"] = True
    if params.top_k > 0 and not params.is_greedy:
        body["top_k"] = params.top_k
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.json_schema:
        body["structured_outputs"] = {"json": params.json_schema}
    elif params.grammar:
        # Lark in llguidance's dialect: the server's backend "auto" (xgrammar, else
        # guidance) or "guidance" takes it.
        body["structured_outputs"] = {"grammar": params.grammar}
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
        body["return_tokens_as_token_ids"] = True  # tokens named `token_id:<id>`, not text
    if request.cache_namespace:
        body["cache_salt"] = cache_salt(request.cache_namespace)
    if request.send_priority:
        body["priority"] = int(request.priority)  # vLLM serves lower values first
    return body


# OpenAI's and vLLM's finish reasons; "stop" on a matched stop string becomes
# "stop_sequence", as the built-in engine says it.
OPENAI_FINISH = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "repetition": "stop",
    "content_filter": "stop",
}


def _openai_finish(reason: Any, stop_reason: Any) -> str | None:
    if reason is None:
        return None
    if reason not in OPENAI_FINISH:
        raise MalformedChunk(f"unknown finish_reason {reason!r}")
    if reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence"
    return OPENAI_FINISH[str(reason)]


def _usage(data: dict[str, Any]) -> tuple[int | None, int | None]:
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return wire.optional_int(usage.get("prompt_tokens")), wire.optional_int(cached)


def _vllm_id(name: Any) -> int:
    prefix, _, digits = str(name).partition(":")
    if prefix != "token_id" or not digits.isdigit():
        raise MalformedChunk(f"logprobs name a token {name!r}, not token_id:<id>")
    return int(digits)


def _vllm_logprobs(value: Any, token_ids: tuple[int, ...], k: int) -> tuple[TokenLogprob, ...]:
    """vLLM's `choices[0].logprobs` for a chunk's tokens: per token its logprob, and
    `top_logprobs` keyed `token_id:<id>` with the sampled token and the k likeliest."""
    if not token_ids:
        return ()
    logprobs = value.get("token_logprobs") if isinstance(value, dict) else None
    tops = value.get("top_logprobs") if isinstance(value, dict) else None
    if not isinstance(logprobs, list) or not isinstance(tops, list):
        raise MalformedChunk("the chunk has no logprobs")
    if not len(logprobs) == len(tops) == len(token_ids):
        raise MalformedChunk("choices[0].logprobs do not match its token_ids")
    if not all(isinstance(top, dict) for top in tops):
        raise MalformedChunk("a top_logprobs entry is not an object")
    return tuple(
        TokenLogprob(
            token,
            wire.logprob(logprob, "token_logprobs"),
            wire.top(((_vllm_id(n), wire.logprob(v, "top_logprobs")) for n, v in top.items()), k),
        )
        for token, logprob, top in zip(token_ids, logprobs, tops, strict=True)
    )


class CompletionsReader(Reader):
    """`/v1/completions` chunks: text per choice, token ids and their logprobs when the
    server adds them (vLLM's `token_ids`), usage in the last chunk."""

    def __init__(self, token_ids: bool, logprobs: int | None = None) -> None:
        super().__init__(logprobs)
        self.token_ids = token_ids

    def read(self, data: dict[str, Any]) -> Delta:
        choices = data.get("choices")
        if not isinstance(choices, list):
            raise MalformedChunk("the chunk has no choices")
        prompt_tokens, cached = _usage(data)
        if not choices:  # the usage chunk
            return Delta(num_prompt_tokens=prompt_tokens, num_cached_prompt_tokens=cached)
        choice = choices[0]
        if not isinstance(choice, dict):
            raise MalformedChunk("a choice is not an object")
        token_ids: tuple[int, ...] = ()
        logprobs: tuple[TokenLogprob, ...] = ()
        if self.token_ids:
            token_ids = wire.ints(choice.get("token_ids") or [], "choices[0].token_ids")
            if self.logprobs is not None:
                logprobs = _vllm_logprobs(choice.get("logprobs"), token_ids, self.logprobs)
        return Delta(
            token_ids=token_ids,
            text=wire.text(choice.get("text"), "choices[0].text"),
            finish_reason=_openai_finish(choice.get("finish_reason"), choice.get("stop_reason")),
            num_prompt_tokens=prompt_tokens,
            num_cached_prompt_tokens=cached,
            logprobs=logprobs,
        )
