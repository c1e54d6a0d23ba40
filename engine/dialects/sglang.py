"""SGLang's native `/generate`: the body a run becomes and `SGLangReader`, which turns its
cumulative chunks into deltas."""

from __future__ import annotations

from typing import Any

from engine.dialects import wire
from engine.dialects.refusals import refuse_unsendable
from engine.dialects.wire import Delta, MalformedChunk, Reader, Request, cache_salt
from engine.outputs import TokenLogprob
from engine.sampling import Priority


def sglang_body(request: Request) -> dict[str, Any]:
    params = request.params
    refuse_unsendable("sglang", params)
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": 0.0 if params.is_greedy else params.temperature,
        "top_p": params.top_p,
        "skip_special_tokens": True,
        **wire.penalties(params),
    }
    if params.top_k > 0 and not params.is_greedy:
        sampling["top_k"] = params.top_k
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    if params.stop:
        sampling["stop"] = list(params.stop)
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        sampling["ignore_eos"] = True
    if params.json_schema:
        sampling["json_schema"] = params.json_schema
    body: dict[str, Any] = {
        "input_ids": list(request.prompt),
        "sampling_params": sampling,
        "stream": True,
    }
    if params.logprobs is not None:
        body["return_logprob"] = True
        body["top_logprobs_num"] = params.logprobs
    if request.adapter:
        body["lora_path"] = request.adapter
    if request.cache_namespace:
        body["cache_salt"] = cache_salt(request.cache_namespace)
    if request.send_priority:
        body["priority"] = max(Priority) - request.priority  # SGLang serves higher first
    return body


SGLANG_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _sglang_entry(value: Any, what: str) -> tuple[int, float]:
    """One `[logprob, token id, text]` entry as (token id, logprob)."""
    token = wire.optional_int(value[1]) if isinstance(value, list) and len(value) == 3 else None
    if token is None:
        raise MalformedChunk(f"{what} has an entry that is not [logprob, token id, text]")
    return token, wire.logprob(value[0], what)


class SGLangReader(Reader):
    """`/generate` chunks: `text` and `output_ids` cumulative over the request (the
    server's default streaming), `meta_info` with the counts, the finish reason and, when
    asked, the logprobs of every output token so far."""

    def __init__(self, logprobs: int | None = None) -> None:
        super().__init__(logprobs)
        self.num_ids = 0
        self.num_chars = 0

    def read(self, data: dict[str, Any]) -> Delta:
        meta = data.get("meta_info")
        if not isinstance(meta, dict):
            raise MalformedChunk("the chunk has no meta_info")
        ids = wire.ints(data.get("output_ids") or [], "output_ids")
        text = wire.text(data.get("text"), "text")
        if len(ids) < self.num_ids or len(text) < self.num_chars:
            raise MalformedChunk("output_ids or text went backwards")
        new_ids, new_text = ids[self.num_ids :], text[self.num_chars :]
        logprobs = self._logprobs(meta, new_ids)
        self.num_ids, self.num_chars = len(ids), len(text)
        finish = meta.get("finish_reason")
        reason = None
        if finish is not None:
            kind = finish.get("type") if isinstance(finish, dict) else None
            if kind not in SGLANG_FINISH:
                raise MalformedChunk(f"unknown finish_reason {finish!r}")
            reason = SGLANG_FINISH[kind]
            if kind == "stop" and isinstance(finish.get("matched"), str):
                reason = "stop_sequence"
        return Delta(
            token_ids=new_ids,
            text=new_text,
            finish_reason=reason,
            num_prompt_tokens=wire.optional_int(meta.get("prompt_tokens")),
            num_cached_prompt_tokens=wire.optional_int(meta.get("cached_tokens")),
            logprobs=logprobs,
        )

    def _logprobs(self, meta: dict[str, Any], new_ids: tuple[int, ...]) -> tuple[TokenLogprob, ...]:
        """The new tokens' entries of `output_token_logprobs` and `output_top_logprobs`
        (the latter sent only for a `top_logprobs_num` above 0), both cumulative."""
        if self.logprobs is None or not new_ids:
            return ()
        end = self.num_ids + len(new_ids)
        entries = meta.get("output_token_logprobs")
        tops = meta.get("output_top_logprobs") if self.logprobs else [None] * end
        if not isinstance(entries, list) or not isinstance(tops, list):
            raise MalformedChunk("the chunk has no logprobs")
        if len(entries) < end or len(tops) < end:
            raise MalformedChunk("the logprobs fall behind output_ids")
        new = []
        for token, entry, top in zip(
            new_ids, entries[self.num_ids : end], tops[self.num_ids : end], strict=True
        ):
            if top is not None and not isinstance(top, list):
                raise MalformedChunk("an output_top_logprobs entry is not a list")
            alternatives = (_sglang_entry(a, "output_top_logprobs") for a in top or ())
            logprob = _sglang_entry(entry, "output_token_logprobs")[1]
            new.append(TokenLogprob(token, logprob, wire.top(alternatives, self.logprobs)))
        return tuple(new)
