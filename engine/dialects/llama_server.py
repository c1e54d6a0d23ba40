"""llama.cpp's server, native `/completion`: the body a run becomes and `LlamaServerReader`,
which reads its chunks."""

from __future__ import annotations

from typing import Any

from engine.dialects import wire
from engine.dialects.refusals import refuse_unsendable
from engine.dialects.wire import Delta, MalformedChunk, Reader, Request
from engine.outputs import TokenLogprob


def llama_server_body(request: Request) -> dict[str, Any]:
    params = request.params
    refuse_unsendable("llama-server", params)
    body: dict[str, Any] = {
        "prompt": list(request.prompt),
        "n_predict": params.max_tokens,
        "temperature": 0.0 if params.is_greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": 1 if params.is_greedy else max(params.top_k, 0),
        "min_p": params.min_p,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": request.share_cache,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.json_schema:
        body["json_schema"] = wire.schema(params.json_schema)
    if params.logprobs is not None:
        # With n_probs 0 it sends no logprobs at all, not even the sampled token's.
        body["n_probs"] = max(params.logprobs, 1)
    penalties = wire.penalties(params, repetition="repeat_penalty")
    penalties.pop("min_p", None)  # sent above: llama-server's default is not 0
    if "logit_bias" in penalties:  # llama-server takes [token id, bias] pairs
        penalties["logit_bias"] = [[token, bias] for token, bias in params.logit_bias]
    return {**body, **penalties}


LLAMA_STOP = {"eos": "stop", "word": "stop_sequence", "limit": "length"}


def _llama_pair(value: Any, what: str) -> tuple[int, float]:
    """One `{"id", "logprob", ...}` object as (token id, logprob)."""
    token = wire.optional_int(value.get("id")) if isinstance(value, dict) else None
    if token is None:
        raise MalformedChunk(f"{what} has an entry without a token id")
    return token, wire.logprob(value.get("logprob"), what)


def _llama_logprobs(value: Any, token_ids: tuple[int, ...], k: int) -> tuple[TokenLogprob, ...]:
    """llama-server's `completion_probabilities` for a chunk's tokens (logprobs, as
    `post_sampling_probs` is left false): per token its own and `top_logprobs`, the
    likeliest `n_probs`."""
    if not token_ids:
        return ()
    if not isinstance(value, list) or len(value) != len(token_ids):
        raise MalformedChunk("completion_probabilities do not match the chunk's tokens")
    new = []
    for token, entry in zip(token_ids, value, strict=True):
        tops = entry.get("top_logprobs") if isinstance(entry, dict) else None
        if not isinstance(tops, list):
            raise MalformedChunk("a completion_probabilities entry has no top_logprobs")
        alternatives = (_llama_pair(top, "top_logprobs") for top in tops)
        logprob = _llama_pair(entry, "completion_probabilities")[1]
        new.append(TokenLogprob(token, logprob, wire.top(alternatives, k)))
    return tuple(new)


class LlamaServerReader(Reader):
    """`/completion` chunks: `content`, `tokens` and, when asked, their
    `completion_probabilities` per chunk, `stop: true` on the last with `stop_type` and
    the prompt's counts."""

    def read(self, data: dict[str, Any]) -> Delta:
        if not isinstance(data.get("stop"), bool):
            raise MalformedChunk("the chunk has no stop flag")
        token_ids = wire.ints(data.get("tokens") or [], "tokens")
        text = wire.text(data.get("content"), "content")
        logprobs: tuple[TokenLogprob, ...] = ()
        if self.logprobs is not None:
            logprobs = _llama_logprobs(
                data.get("completion_probabilities"), token_ids, self.logprobs
            )
        if not data["stop"]:
            return Delta(token_ids=token_ids, text=text, logprobs=logprobs)
        stop_type = data.get("stop_type")
        if stop_type not in LLAMA_STOP:
            raise MalformedChunk(f"unknown stop_type {stop_type!r}")
        timings = data.get("timings")
        timings = timings if isinstance(timings, dict) else {}
        evaluated = wire.optional_int(data.get("tokens_evaluated"))
        cached = wire.optional_int(timings.get("cache_n"))
        return Delta(
            token_ids=token_ids,
            text=text,
            finish_reason=LLAMA_STOP[stop_type],
            num_prompt_tokens=evaluated,
            num_cached_prompt_tokens=cached,
            logprobs=logprobs,
        )
