"""OpenAI's Responses API request (`POST /v1/responses`) and its translation into
admission's `GenerateParams` (no I/O).

A response is a run: `resp_<hex>` names the run `run_<hex>`. Its `input` (a string, or
a list of messages, function calls and their outputs) becomes chat turns after the
previous response's conversation (`previous_response_id`), with `instructions` as a
system turn ahead of them, which a next turn does not inherit. `text.format`, `tools` and
`tool_choice` become the same `Structure` as the chat endpoint's `response_format`,
`tools` and `tool_choice`. Unknown fields are ignored; fields Tollgate cannot honour are
refused with a 400 naming them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ConfigDict

from engine.structure import ToolCall
from services.admission.http.requests import (
    ROLE_ALIASES,
    _Common,
    _common_violations,
    _params,
    param_names,
)
from services.admission.http.tools import structure_names, structure_of
from services.admission.requests import ChatTurn, GenerateParams, Limits
from services.core.errors import FieldViolation, InvalidArgument, NotFound
from services.core.validation import shown

RESPONSE_PREFIX = "resp_"
RUN_PREFIX = "run_"
INPUT_ROLES = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# The request's fields its row keeps as they were sent.
KEPT = (
    "instructions",
    "metadata",
    "temperature",
    "top_p",
    "max_output_tokens",
    "previous_response_id",
    "background",
    "store",
    "parallel_tool_calls",
    "user",
)


class ResponseRequest(_Common):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    background: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's, which Tollgate cannot honour: refused when set.
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    truncation: str | None = None


def run_id_of(response_id: str) -> str:
    """The run a response id names; NotFound for an id that is not a response's."""
    if not response_id.startswith(RESPONSE_PREFIX):
        raise NotFound(f"response {shown(response_id)} not found")
    return RUN_PREFIX + response_id.removeprefix(RESPONSE_PREFIX)


def response_id_of(run_id: str) -> str:
    return RESPONSE_PREFIX + run_id.removeprefix(RUN_PREFIX)


@dataclass(frozen=True, slots=True)
class Translated:
    """A response request as admission takes it, and what its row keeps: the input items
    (ids still to be given, `with_ids`), the conversation without instructions, and the
    fields the Response object echoes."""

    params: GenerateParams
    input_items: tuple[dict[str, Any], ...]
    conversation: tuple[ChatTurn, ...]
    request: dict[str, Any]


def response_params(
    body: ResponseRequest,
    headers: Mapping[str, str],
    limits: Limits,
    previous: Sequence[ChatTurn] = (),
) -> Translated:
    """`previous`: the previous response's conversation and output, as chat turns.
    Raises InvalidArgument naming OpenAI's parameter."""
    violations = [*_common_violations(body), *_refused(body)]
    items, turns = _input(body.input, violations)
    structure = structure_of(
        _response_format(body.text, violations),
        [_chat_tool(tool) for tool in body.tools or ()],
        _chat_tool_choice(body.tool_choice),
        body.parallel_tool_calls,
        violations,
    )
    if violations:
        raise InvalidArgument([_renamed(v) for v in violations])
    conversation = (*previous, *turns)
    system = (ChatTurn("system", body.instructions),) if body.instructions else ()
    max_tokens = body.max_tokens if body.max_output_tokens is None else body.max_output_tokens
    params = _params(
        body, headers, limits, max_tokens, messages=(*system, *conversation), structure=structure
    )
    if body.background:
        params = replace(params, detached=True)
    return Translated(params, items, conversation, _echo(body))


def response_param_names(body: ResponseRequest) -> dict[str, str]:
    """OpenAI's name for each field path admission's validation may report."""
    names = param_names(body) | {
        "prompt": "input",
        "messages": "input",
        "sampling.max_tokens": "max_output_tokens",
    }
    names |= structure_names("text.format", "text.format.schema", "", len(body.tools or ()))
    if body.max_output_tokens is None and body.max_tokens is not None:
        names["sampling.max_tokens"] = "max_tokens"
    return names


def with_ids(items: Sequence[Mapping[str, Any]], run_id: str) -> list[dict[str, Any]]:
    """The input items with ids of their own, derived from the run's (one sent is kept)."""
    hex_id = run_id.removeprefix(RUN_PREFIX)
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
    return [
        {"id": item.get("id") or f"{prefixes[item['type']]}_{hex_id}_in{i}", **item}
        for i, item in enumerate(items)
    ]


def turn_json(turn: ChatTurn) -> dict[str, Any]:
    calls = [[c.id, c.name, c.arguments] for c in turn.tool_calls]
    return {
        "role": turn.role,
        "content": turn.content,
        "tool_calls": calls,
        "tool_call_id": turn.tool_call_id,
    }


def turn_of(data: Mapping[str, Any]) -> ChatTurn:
    calls = tuple(ToolCall(*call) for call in data.get("tool_calls", ()))
    return ChatTurn(data["role"], data["content"], calls, data.get("tool_call_id", ""))


def _renamed(violation: FieldViolation) -> FieldViolation:
    """A violation of the chat shapes `structure_of` reads, under the Responses API's name."""
    if violation.field.startswith("response_format"):
        return FieldViolation("text.format.schema", violation.description)
    return violation


def _refused(body: ResponseRequest) -> list[FieldViolation]:
    found = []
    for name in ("conversation", "prompt", "max_tool_calls"):
        if getattr(body, name) is not None:
            found.append(FieldViolation(name, "is not supported"))
    if body.include:
        found.append(FieldViolation("include", "is not supported"))
    if body.top_logprobs:
        found.append(FieldViolation("top_logprobs", "is not supported"))
    if body.truncation not in (None, "disabled"):
        found.append(FieldViolation("truncation", 'only "disabled" is supported'))
    if body.n not in (None, 1):
        found.append(FieldViolation("n", "a response has one answer"))
    if body.background and body.store is False:
        found.append(FieldViolation("background", "a background response must be stored"))
    return found


def _input(
    given: str | list[dict[str, Any]], found: list[FieldViolation]
) -> tuple[tuple[dict[str, Any], ...], tuple[ChatTurn, ...]]:
    """The input items as the input_items endpoint lists them, and their chat turns."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    if not given:
        found.append(FieldViolation("input", "must not be empty"))
    read = _InputRead(found)
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            found.append(FieldViolation(f"input[{i}].type", "must be a string"))
        elif kind == "message":
            read.message(item, f"input[{i}]")
        elif kind == "function_call":
            read.function_call(item, f"input[{i}]")
        elif kind == "function_call_output":
            read.function_call_output(item, f"input[{i}]")
        else:
            found.append(FieldViolation(f"input[{i}].type", f"{shown(str(kind))} is not supported"))
    return tuple(read.items), tuple(read.turns)


@dataclass(slots=True)
class _InputRead:
    """Input items read so far, as items and as chat turns; what is wrong goes to `found`."""

    found: list[FieldViolation]
    items: list[dict[str, Any]] = field(default_factory=list)
    turns: list[ChatTurn] = field(default_factory=list)

    def message(self, item: Mapping[str, Any], at: str) -> None:
        role, content = item.get("role"), item.get("content")
        if not isinstance(role, str) or role not in INPUT_ROLES:
            roles = ", ".join(sorted(INPUT_ROLES))
            self.found.append(FieldViolation(f"{at}.role", f"must be one of {roles}"))
            return
        text = content if isinstance(content, str) else _parts_text(content)
        if text is None:
            self.found.append(
                FieldViolation(f"{at}.content", "only text content parts are supported")
            )
            return
        if role == "assistant":
            part = {"type": "output_text", "text": text, "annotations": []}
        else:
            part = {"type": "input_text", "text": text}
        self.items.append(
            {"type": "message", "role": role, "content": [part], "status": "completed"}
        )
        self.turns.append(ChatTurn(ROLE_ALIASES.get(role, role), text))

    def function_call(self, item: Mapping[str, Any], at: str) -> None:
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not all(isinstance(v, str) for v in (call_id, name, arguments)):
            self.found.append(FieldViolation(at, "give call_id, name and arguments"))
            return
        call = ToolCall(str(call_id), str(name), str(arguments))
        self.items.append(
            {
                "type": "function_call",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
        # Calls made together are one assistant turn.
        if self.turns and self.turns[-1].role == "assistant" and self.turns[-1].tool_calls:
            last = self.turns.pop()
            self.turns.append(last._replace(tool_calls=(*last.tool_calls, call)))
        else:
            self.turns.append(ChatTurn("assistant", "", (call,)))

    def function_call_output(self, item: Mapping[str, Any], at: str) -> None:
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(output, str) or not isinstance(call_id, str):
            self.found.append(FieldViolation(f"{at}.output", "give call_id and output text"))
            return
        self.items.append(
            {
                "type": "function_call_output",
                "call_id": call_id,
                "output": output,
                "status": "completed",
            }
        )
        self.turns.append(ChatTurn("tool", output, (), call_id))


def _parts_text(content: Any) -> str | None:
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            return None
        text = part.get("text")
        if not isinstance(text, str):
            return None
        texts.append(text)
    return "".join(texts)


def _response_format(
    text: Mapping[str, Any] | None, found: list[FieldViolation]
) -> dict[str, Any] | None:
    """`text.format` in the chat endpoint's `response_format` shape."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        found.append(FieldViolation("text.format", "give an object with its type"))
        return None
    if spec.get("type") != "json_schema":
        return {"type": spec.get("type")}
    json_schema = {"name": spec.get("name", ""), "schema": spec.get("schema")}
    return {"type": "json_schema", "json_schema": json_schema}


def _chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses function tool in the chat endpoint's shape (other types are refused)."""
    if tool.get("type") != "function":
        return {"type": tool.get("type")}
    keys = ("name", "description", "parameters")
    return {"type": "function", "function": {k: tool[k] for k in keys if k in tool}}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name", "")}}
    return choice


def _echo(body: ResponseRequest) -> dict[str, Any]:
    echoed = {name: getattr(body, name) for name in KEPT}
    echoed["text"] = {"format": (body.text or {}).get("format") or {"type": "text"}}
    echoed["tools"] = [_tool_echo(tool) for tool in body.tools or ()]
    echoed["tool_choice"] = body.tool_choice or ("auto" if body.tools else "none")
    return echoed


def _tool_echo(tool: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.get("name", ""),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }
