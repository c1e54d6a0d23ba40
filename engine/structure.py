"""What an answer must look like (pure): OpenAI's `response_format` and function tools
turned into the sampler's constraint (a JSON schema or a Lark grammar), and the generic
tool-calling prompt. The calls are read back from an answer by `tollgate.structure`,
which the SDK shares.

The generic tool format serves every model: the tool definitions go into the system turn,
and the answer is constrained to be either text or one JSON object
`{"tool_calls": [{"name": ..., "arguments": {...}}]}`, whose arguments validate against
the function's parameters. A text answer cannot start with `{`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("auto", "none", "required", "function")
MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ANY_OBJECT = '{"type": "object"}'
# JSON laid out as `json.dumps` writes it, llguidance's compile options for every schema
# (a schema's own "x-guidance" wins): its default lets whitespace in anywhere, and a model
# that falls into emitting it never closes the object.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Text that is not a call: anything, but for a first character that opens one.
_TEXT_RULE = r"text: /[^{\s][\s\S]*/"


def json_value(text: str | bytes) -> Any:
    """`json.loads`, with JSON nested deeper than Python's stack reaches raised as the
    ValueError that malformed JSON is, so that every caller refuses it the same way."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str = ""
    parameters: str = ""  # the JSON schema of its arguments as text; "" = any object


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text


@dataclass(frozen=True, slots=True)
class Structure:
    """A request's response format and tools, as the gRPC `SamplingParams` carries them."""

    response_format: str = "text"
    json_schema: str = ""  # for "json_schema": the schema as JSON text
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: str = "auto"
    function: str = ""  # for tool_choice "function"
    parallel_tool_calls: bool = True

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may be function calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constrained(self) -> bool:
        return self.calls_tools or self.response_format != "text"

    def violations(self) -> list[tuple[str, str]]:
        """(field, why) for each malformed part, fields named as `SamplingParams` names them."""
        found = []
        if self.response_format not in RESPONSE_FORMATS:
            found.append(("response_format.type", f"must be one of {', '.join(RESPONSE_FORMATS)}"))
        elif self.response_format == "json_schema":
            problem = _schema_problem(self.json_schema, required=True)
            if problem:
                found.append(("response_format.json_schema", problem))
        if len(self.tools) > MAX_TOOLS:
            found.append(("tools", f"at most {MAX_TOOLS} tools"))
        names = [tool.name for tool in self.tools]
        for i, tool in enumerate(self.tools):
            if not FUNCTION_NAME.fullmatch(tool.name):
                found.append((f"tools[{i}].name", "1 to 64 of a-z, A-Z, 0-9, '_' and '-'"))
            elif names.index(tool.name) != i:
                found.append((f"tools[{i}].name", f"{tool.name!r} is named twice"))
            problem = _schema_problem(tool.parameters, required=False)
            if problem:
                found.append((f"tools[{i}].parameters", problem))
        if self.tool_choice not in TOOL_CHOICES:
            found.append(("tool_choice.mode", f"must be one of {', '.join(TOOL_CHOICES)}"))
        elif self.tool_choice in ("required", "function") and not self.tools:
            found.append(("tool_choice.mode", f"{self.tool_choice!r} needs tools"))
        elif self.tool_choice == "function" and self.function not in names:
            found.append(("tool_choice.function", f"no tool is named {self.function!r}"))
        return found

    def constraint(self) -> tuple[str, str]:
        """(json_schema, grammar) for the sampler: at most one is set, both "" for free text.
        Call only when `violations()` is empty."""
        answer = self._answer_schema()
        if not self.calls_tools:
            return answer, ""
        if self.tool_choice != "auto":
            return json.dumps(self._calls_schema()), ""
        # A grammar's embedded schemas get no compile options but their own.
        calls = json.dumps({**self._calls_schema(), "x-guidance": JSON_LAYOUT})
        if not answer:
            return "", f"start: calls | text\ncalls: %json {calls}\n{_TEXT_RULE}\n"
        laid_out = json.loads(answer)
        if isinstance(laid_out, dict):
            laid_out = {"x-guidance": JSON_LAYOUT, **laid_out}
        answer = json.dumps(laid_out)
        return "", f"start: calls | answer\ncalls: %json {calls}\nanswer: %json {answer}\n"

    def system_prompt(self) -> str:
        """What the system turn tells the model of its tools; "" without tools to call."""
        if not self.calls_tools:
            return ""
        tools = [
            {"name": t.name, "description": t.description, "parameters": _parameters(t)}
            for t in self.tools
            if self.tool_choice != "function" or t.name == self.function
        ]
        how = (
            'To call tools, answer with only a JSON object: {"tool_calls": [{"name": '
            '"<tool name>", "arguments": {<its arguments>}}]}.'
        )
        if self.tool_choice == "auto":
            how += " Otherwise answer in text."
        return f"You can call these tools:\n{json.dumps(tools, ensure_ascii=False)}\n{how}"

    def _answer_schema(self) -> str:
        if self.response_format == "json_object":
            return ANY_OBJECT
        if self.response_format == "json_schema":
            return self.json_schema
        return ""

    def _calls_schema(self) -> dict[str, Any]:
        chosen = [
            t for t in self.tools if self.tool_choice != "function" or t.name == self.function
        ]
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": _parameters(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in chosen
        ]
        calls: dict[str, Any] = {
            "type": "array",
            "items": call[0] if len(call) == 1 else {"anyOf": call},
            "minItems": 1,
        }
        if not self.parallel_tool_calls or self.tool_choice == "function":
            calls["maxItems"] = 1
        return {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }


FREE_TEXT = Structure()


def calls_text(calls: Sequence[ToolCall]) -> str:
    """An assistant's earlier calls written as the generic format has the model write them."""
    written = []
    for call in calls:
        try:
            arguments = json_value(call.arguments or "{}")
        except ValueError:
            arguments = call.arguments
        written.append({"name": call.name, "arguments": arguments})
    return json.dumps({"tool_calls": written}, ensure_ascii=False)


def _parameters(tool: FunctionTool) -> Any:
    return json_value(tool.parameters or ANY_OBJECT)


def _schema_problem(text: str, *, required: bool) -> str:
    if not text:
        return "give the schema" if required else ""
    try:
        value = json_value(text)
    except ValueError as exc:
        return "is nested too deeply" if str(exc) == "JSON nested too deeply" else "is not JSON"
    return "" if isinstance(value, dict | bool) else "must be a JSON object (a schema)"
