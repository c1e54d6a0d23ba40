"""What each kind of engine server cannot honour: by the fields of SamplingParams' JSON form
for admission to refuse (`UNSUPPORTED`, `unsupported`), and by SamplingParams' own fields
for a body to refuse (`UNSENDABLE`, `refuse_unsendable`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import RequestError
from engine.sampling import SamplingParams

# SamplingParams' JSON form, as the `queued` event stores it: unset fields absent.
Sampling = Mapping[str, Any]


def _answer_format(sampling: Sampling) -> bool:
    """A response format other than text: the answer follows a JSON schema."""
    answer = sampling.get("response_format")
    return isinstance(answer, dict) and answer.get("type") not in (None, "", "text")


def _tool_mode(sampling: Sampling) -> str | None:
    """tool_choice's mode when tools are given ("auto" when unset), None without tools."""
    if not sampling.get("tools"):
        return None
    choice = sampling.get("tool_choice")
    return (choice.get("mode") if isinstance(choice, dict) else None) or "auto"


def _calls_tools(sampling: Sampling) -> bool:
    return _tool_mode(sampling) not in (None, "none")


def _needs_lark(sampling: Sampling) -> bool:
    """Tools with tool_choice auto: the answer is text or calls, which only a Lark grammar
    says; tool_choice required or a named function is a JSON schema, but for the "hermes"
    format, whose `<tool_call>` blocks are a grammar too."""
    mode = _tool_mode(sampling)
    return mode == "auto" or (
        mode not in (None, "none") and sampling.get("tool_format") == "hermes"
    )


@dataclass(frozen=True, slots=True)
class Refusal:
    """A field of SamplingParams' JSON form that a kind of server cannot honour, and why.
    `asks` tells whether a request asks for it; by default, the field being set (present,
    and not empty, zero or its NEUTRAL value)."""

    field: str
    why: str
    asks: Callable[[Sampling], bool] | None = None

    def asked_by(self, sampling: Sampling) -> bool:
        if self.asks is not None:
            return self.asks(sampling)
        value = sampling.get(self.field)
        return bool(value) and value != NEUTRAL.get(self.field)


# The values that leave a field off, beside absent, zero and empty.
NEUTRAL = {"repetition_penalty": 1.0, "n": 1}
NO_LARK = "no Lark grammar, which tools with tool_choice auto need"
NO_OUTPUT_FORMAT = "OpenAI's completions API constrains no output"
NO_LOGPROB_IDS = "OpenAI's completions API names the tokens of its logprobs by text, not id"
NO_ANSWERS = Refusal("n", "only the built-in engine draws several answers (n > 1)")
NO_PROMPT_LOGPROBS = Refusal(
    "prompt_logprobs", "only the built-in engine returns a prompt's logprobs (echo)"
)
# What each kind of server cannot honour, in the order admission names it.
UNSUPPORTED: dict[str, tuple[Refusal, ...]] = {
    "openai": (
        Refusal("top_k", "OpenAI's completions API has no top_k"),
        Refusal("ignore_eos", "OpenAI's completions API has no ignore_eos"),
        Refusal("stop_token_ids", "OpenAI's completions API returns no token ids to stop on"),
        Refusal("repetition_penalty", "OpenAI's completions API has no repetition_penalty"),
        Refusal("min_p", "OpenAI's completions API has no min_p"),
        Refusal("response_format", NO_OUTPUT_FORMAT, _answer_format),
        Refusal("tools", NO_OUTPUT_FORMAT, _calls_tools),
        Refusal("logprobs", NO_LOGPROB_IDS),
        NO_ANSWERS,
        NO_PROMPT_LOGPROBS,
    ),
    "vllm": (NO_ANSWERS, NO_PROMPT_LOGPROBS),
    "sglang": (
        Refusal("tools", f"SGLang takes JSON schemas but {NO_LARK}", _needs_lark),
        NO_ANSWERS,
        NO_PROMPT_LOGPROBS,
    ),
    "llama-server": (
        Refusal("tools", f"llama-server takes JSON schemas but {NO_LARK}", _needs_lark),
        NO_ANSWERS,
        NO_PROMPT_LOGPROBS,
    ),
}
# The same, by SamplingParams' own fields, for the bodies: a run can reach a server that
# cannot honour it where other kinds serve its model too.
UNSENDABLE: dict[str, dict[str, str]] = {
    "openai": {
        "json_schema": NO_OUTPUT_FORMAT,
        "grammar": NO_OUTPUT_FORMAT,
        "logprobs": NO_LOGPROB_IDS,
    },
    "sglang": {"grammar": f"SGLang takes {NO_LARK}"},
    "llama-server": {"grammar": f"llama-server takes {NO_LARK}"},
}


def unsupported(kind: str, sampling: Sampling) -> tuple[str, str] | None:
    """The first field `sampling` (SamplingParams' JSON form, unset fields absent) asks
    for that a `kind` server cannot honour, with why; None when it asks for none."""
    for refusal in UNSUPPORTED.get(kind, ()):
        if refusal.asked_by(sampling):
            return refusal.field, refusal.why
    return None


def refuse_unsendable(kind: str, params: SamplingParams) -> None:
    for name, why in UNSENDABLE[kind].items():
        if getattr(params, name) not in ("", None):
            raise RequestError(f"{name}: {why}")
