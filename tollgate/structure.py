"""What an answer must look like, on the client's side: OpenAI's `response_format`, `tools`,
`tool_choice` and tool-carrying chat messages as `tollgate.v1` fields, and the function
calls read back from an answer.

A run that may call tools answers either with text or with calls in the model's tool
format: one JSON object `{"tool_calls": [{"name": ..., "arguments": {...}}]}` (generic),
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks (hermes), or one
object `{"name": ..., "parameters": {...}}` (llama3); `tool_calls_of` reads any of them.
Only the shapes are checked here; the gateway checks what they say (INVALID_ARGUMENT).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tollgate.types import ToolCall
from tollgate.v1 import events_pb2

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICE_MODES = ("auto", "none", "required")
_HERMES_OPEN = "<tool_call>"
# One hermes block, and the whitespace after it.
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>\s*", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Structure:
    """A run's response format and tools in OpenAI's shapes; None leaves one off.

    `json_schema` is a schema alone, short for `response_format={"type": "json_schema",
    "json_schema": {"schema": ...}}`.
    """

    response_format: Mapping[str, Any] | None = None
    json_schema: Mapping[str, Any] | bool | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def fields(self) -> dict[str, Any]:
        """SamplingParams' fields for those set; ValueError names a malformed argument."""
        found: dict[str, Any] = {}
        if self.response_format is not None and self.json_schema is not None:
            raise ValueError("json_schema: give it or response_format, not both")
        if self.response_format is not None:
            found["response_format"] = response_format_of(self.response_format)
        if self.json_schema is not None:
            schema = schema_text("json_schema", self.json_schema)
            found["response_format"] = events_pb2.ResponseFormat(
                type="json_schema", json_schema=schema
            )
        if self.tools is not None:
            found["tools"] = tools_of(self.tools)
        if self.tool_choice is not None:
            found["tool_choice"] = tool_choice_of(self.tool_choice)
        if self.parallel_tool_calls is not None:
            found["parallel_tool_calls"] = self.parallel_tool_calls
        return found


def response_format_of(value: Mapping[str, Any]) -> events_pb2.ResponseFormat:
    """`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}}}` (or `{"type": "text"}`)."""
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"response_format: type must be one of {', '.join(RESPONSE_FORMATS)}")
    if kind != "json_schema":
        return events_pb2.ResponseFormat(type=kind)
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or "schema" not in spec:
        raise ValueError("response_format: json_schema must be {'name': ..., 'schema': {...}}")
    schema = schema_text("response_format.json_schema.schema", spec["schema"])
    return events_pb2.ResponseFormat(type=kind, json_schema=schema)


def schema_text(argument: str, schema: Any) -> str:
    """A JSON schema (an object, or true/false) as JSON text."""
    if not isinstance(schema, Mapping | bool):
        raise ValueError(f"{argument}: must be a JSON schema (a dict)")
    return _json_text(argument, schema)


def _json_text(argument: str, value: Mapping[str, Any] | bool) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{argument}: not JSON ({exc})") from None


def tools_of(tools: Sequence[Mapping[str, Any]]) -> list[events_pb2.FunctionTool]:
    """OpenAI's `[{"type": "function", "function": {"name", "description", "parameters"}}]`."""
    if isinstance(tools, str | Mapping) or not isinstance(tools, Sequence):
        raise ValueError("tools: must be a list of tools")
    return [_function_tool(f"tools[{i}]", tool) for i, tool in enumerate(tools)]


def _function_tool(where: str, tool: Any) -> events_pb2.FunctionTool:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(function, Mapping) or tool.get("type") != "function":
        raise ValueError(f"{where}: must be {{'type': 'function', 'function': {{...}}}}")
    name, description = function.get("name"), function.get("description") or ""
    if not isinstance(name, str) or not isinstance(description, str):
        raise ValueError(f"{where}: the function's name and description must be strings")
    parameters = function.get("parameters")
    return events_pb2.FunctionTool(
        name=name,
        description=description,
        parameters="" if parameters is None else schema_text(f"{where}.parameters", parameters),
    )


def tool_choice_of(value: str | Mapping[str, Any]) -> events_pb2.ToolChoice:
    """One of "auto", "none", "required", or `{"type": "function", "function": {"name": ...}}`."""
    if isinstance(value, str) and value in TOOL_CHOICE_MODES:
        return events_pb2.ToolChoice(mode=value)
    if isinstance(value, Mapping) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str):
            return events_pb2.ToolChoice(mode="function", function=name)
    raise ValueError(
        "tool_choice: must be 'auto', 'none', 'required' or"
        " {'type': 'function', 'function': {'name': ...}}"
    )


def chat_message_of(where: str, message: Mapping[str, Any]) -> events_pb2.ChatMessage:
    """An OpenAI chat message: `content` may be None beside an assistant's `tool_calls`,
    and a "tool" message names the call it answers in `tool_call_id`."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not isinstance(content, str | None):
        raise ValueError(f"{where}: needs a role and text content")
    calls = message.get("tool_calls") or ()
    if isinstance(calls, str | Mapping) or not isinstance(calls, Sequence):
        raise ValueError(f"{where}.tool_calls: must be a list of calls")
    return events_pb2.ChatMessage(
        role=role,
        content=content or "",
        tool_calls=[_tool_call(f"{where}.tool_calls[{i}]", c) for i, c in enumerate(calls)],
        tool_call_id=str(message.get("tool_call_id") or ""),
    )


def tool_call_message(call: ToolCall) -> events_pb2.ToolCall:
    return events_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments)


def _tool_call(where: str, call: Any) -> events_pb2.ToolCall:
    """A ToolCall, or OpenAI's `{"id", "type": "function", "function": {"name",
    "arguments"}}` with the arguments as JSON text or a dict."""
    if isinstance(call, ToolCall):
        return tool_call_message(call)
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}: must be {{'id': ..., 'function': {{'name', 'arguments'}}}}")
    name, arguments = function["name"], function.get("arguments", "{}")
    if isinstance(arguments, Mapping):
        arguments = _json_text(f"{where}.function.arguments", arguments)
    elif not isinstance(arguments, str):
        raise ValueError(f"{where}.function.arguments: must be a JSON object, as text or a dict")
    return events_pb2.ToolCall(id=str(call.get("id") or ""), name=name, arguments=arguments)


def may_open_calls(text: str) -> bool:
    """Whether an answer that starts with `text` may still turn out to be calls: until
    it cannot, a stream holds it back."""
    opened = text.lstrip()
    return (
        opened[:1] in ("", "{")
        or _HERMES_OPEN.startswith(opened)
        or opened.startswith(_HERMES_OPEN)
    )


def tool_calls_of(text: str, run_id: str) -> tuple[ToolCall, ...] | None:
    """The function calls an answer makes, in any tool format; None when it is text.

    Each id is derived from the run's as the gateway derives it, so the SDK and the HTTP
    API name a run's calls alike."""
    opened = text.strip()
    if opened.startswith(_HERMES_OPEN):
        calls = _hermes_calls(opened)
    elif opened.startswith("{"):
        calls = _json_calls(opened)
    else:
        return None
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return None
    found = []
    for i, call in enumerate(calls):
        digest = hashlib.sha256(f"{run_id}:{i}".encode()).hexdigest()[:24]
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        found.append(ToolCall(f"call_{digest}", call["name"], arguments))
    return tuple(found)


def _json_calls(text: str) -> list[Any] | None:
    """The generic object's calls, or a llama3 object as the one call (its "parameters"
    as the arguments)."""
    value = _json(text)
    if not isinstance(value, dict):
        return None
    if value.keys() == {"name", "parameters"}:
        return [{"name": value["name"], "arguments": value["parameters"]}]
    calls = value.get("tool_calls")
    return calls if isinstance(calls, list) else None


def _hermes_calls(text: str) -> list[Any] | None:
    """The JSON of each `<tool_call>` block; None unless the blocks are the whole text."""
    blocks = list(_HERMES_BLOCK.finditer(text))
    if not blocks or sum(len(b.group(0)) for b in blocks) != len(text) or blocks[0].start():
        return None
    return [_json(block.group(1)) for block in blocks]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
        return None
