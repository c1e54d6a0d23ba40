"""What an answer must look like (pure): OpenAI's `response_format` and function tools
turned into the sampler's constraint (a JSON schema or a Lark grammar), and the tool
formats a model may write its calls in. The calls are read back from an answer by
`tollgate.structure`, which the SDK shares.

The generic tool format serves every model: the tool definitions go into the system turn,
and the answer is constrained to be either text or one JSON object
`{"tool_calls": [{"name": ..., "arguments": {...}}]}`, whose arguments validate against
the function's parameters.

A model whose chat template shows it tools has a format of its own, which it was trained
on; the template is given the tools and the earlier calls (`template_tools`,
`template_calls`) and the answer is constrained to that format:

- "hermes" (Hermes, Qwen2.5, Qwen3): one or more blocks
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one per line.
- "llama3" (Llama 3.1 to 3.3): one JSON object `{"name": ..., "parameters": {...}}`, a
  single call.

In every format a text answer cannot start the way calls in any format start (`{`,
`<tool_call>`), so that what reads as calls is calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
TOOL_CHOICES = ("auto", "none", "required", "function")
TOOL_FORMATS = ("generic", "hermes", "llama3")
# The formats whose chat template shows the model its tools and earlier calls itself.
TEMPLATE_FORMATS = ("hermes", "llama3")
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
# Text that is not a call in any format (`tollgate.structure` reads them all): anything
# that does not open with `{` or `<tool_call>`, nor with whitespace. `&` and `~` apply
# to tokens only, hence TEXT.
_TEXT_RULE = "text: TEXT\n" + r"TEXT: /[^{\s][\s\S]*/ & ~/<tool_call>[\s\S]*/"
_HERMES_CALL = r'call: "<tool_call>\n" body "\n</tool_call>"'
# What a template asks its model to write: `<tool_call>` blocks of `{"name":
# <function-name>, "arguments": ...}`, or Llama's `{"name": function name, "parameters":
# ...}` (some templates escape the quotes).
_HERMES_ASKS = ("<tool_call>", "<function-name>", "arguments")
_LLAMA3_ASKS = re.compile(r'\\?"name\\?":\s*function name,\s*\\?"parameters\\?"')


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
    # One of TOOL_FORMATS; "" = not chosen: admission chooses the model's own, and an
    # engine given "" writes the generic format.
    tool_format: str = "generic"

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may be function calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constrained(self) -> bool:
        return self.calls_tools or self.response_format != "text"

    @property
    def may_call_several(self) -> bool:
        """Whether one answer may make several calls (llama3 writes one call a turn)."""
        return (
            self.parallel_tool_calls
            and self.tool_choice != "function"
            and self.tool_format != "llama3"
        )

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
        if self.tool_format not in ("", *TOOL_FORMATS):
            found.append(("tool_format", f"must be one of {', '.join(TOOL_FORMATS)}"))
        return found

    def constraint(self) -> tuple[str, str]:
        """(json_schema, grammar) for the sampler: at most one is set, both "" for free text.
        Call only when `violations()` is empty."""
        answer = self._answer_schema()
        if not self.calls_tools:
            return answer, ""
        if self.tool_format == "hermes":
            return "", self._hermes_grammar(answer)
        if self.tool_choice != "auto":
            return json.dumps(self._calls_schema()), ""
        # A grammar's embedded schemas get no compile options but their own.
        calls = _laid_out(self._calls_schema())
        if not answer:
            return "", f"start: calls | text\ncalls: %json {calls}\n{_TEXT_RULE}\n"
        answer = _laid_out(json.loads(answer))
        return "", f"start: calls | answer\ncalls: %json {calls}\nanswer: %json {answer}\n"

    def system_prompt(self) -> str:
        """What the system turn tells the model of its tools; "" without tools to call, or
        when the chat template shows them itself (`template_tools`)."""
        if not self.calls_tools or self.tool_format in TEMPLATE_FORMATS:
            return ""
        tools = [
            {"name": t.name, "description": t.description, "parameters": _parameters(t)}
            for t in self._chosen()
        ]
        how = (
            'To call tools, answer with only a JSON object: {"tool_calls": [{"name": '
            '"<tool name>", "arguments": {<its arguments>}}]}.'
        )
        if self.tool_choice == "auto":
            how += " Otherwise answer in text."
        return f"You can call these tools:\n{json.dumps(tools, ensure_ascii=False)}\n{how}"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for a chat template that shows them itself, in OpenAI's shape
        (`[{"type": "function", "function": {"name", "description", "parameters"}}]`, as
        transformers' `apply_chat_template(tools=...)` takes them); None when the template
        is told of none: the generic format, or no tools to call."""
        if not self.calls_tools or self.tool_format not in TEMPLATE_FORMATS:
            return None
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": _parameters(t),
                },
            }
            for t in self._chosen()
        ]

    def _chosen(self) -> list[FunctionTool]:
        return [t for t in self.tools if self.tool_choice != "function" or t.name == self.function]

    def _answer_schema(self) -> str:
        if self.response_format == "json_object":
            return ANY_OBJECT
        if self.response_format == "json_schema":
            return self.json_schema
        return ""

    def _call_schema(self, arguments: str) -> dict[str, Any]:
        """One call: `{"name": ..., <arguments>: {...}}` for any chosen tool."""
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, arguments: _parameters(t)},
                "required": ["name", arguments],
                "additionalProperties": False,
            }
            for t in self._chosen()
        ]
        return call[0] if len(call) == 1 else {"anyOf": call}

    def _calls_schema(self) -> dict[str, Any]:
        if self.tool_format == "llama3":
            return self._call_schema("parameters")
        calls: dict[str, Any] = {
            "type": "array",
            "items": self._call_schema("arguments"),
            "minItems": 1,
        }
        if not self.may_call_several:
            calls["maxItems"] = 1
        return {
            "type": "object",
            "properties": {"tool_calls": calls},
            "required": ["tool_calls"],
            "additionalProperties": False,
        }

    def _hermes_grammar(self, answer: str) -> str:
        more = ' ("\\n" call)*' if self.may_call_several else ""
        body = _laid_out(self._call_schema("arguments"))
        rules = f"calls: call{more}\n{_HERMES_CALL}\nbody: %json {body}\n"
        if self.tool_choice != "auto":
            return f"start: calls\n{rules}"
        if answer:
            return f"start: calls | answer\n{rules}answer: %json {_laid_out(json.loads(answer))}\n"
        return f"start: calls | text\n{rules}{_TEXT_RULE}\n"


FREE_TEXT = Structure()


@lru_cache(maxsize=64)
def tool_format_of(chat_template: str | None) -> str:
    """The tool format a chat template teaches its model: "hermes" for one that asks for
    `<tool_call>` blocks of `{"name", "arguments"}` (Hermes, Qwen2.5, Qwen3), "llama3" for
    one that asks for a `{"name", "parameters"}` object (Llama 3.1 to 3.3), else "generic"
    (a template that shows no tools, or none at all)."""
    if not chat_template or "tools" not in chat_template:
        return "generic"
    if all(part in chat_template for part in _HERMES_ASKS):
        return "hermes"
    if _LLAMA3_ASKS.search(chat_template):
        return "llama3"
    return "generic"


def calls_text(calls: Sequence[ToolCall], tool_format: str = "generic") -> str:
    """An assistant's earlier calls written as the model writes them in `tool_format`
    (llama3 writes one call a turn: several are one object a line)."""
    if tool_format == "hermes":
        return "\n".join(f"<tool_call>\n{_call_json(c, 'arguments')}\n</tool_call>" for c in calls)
    if tool_format == "llama3":
        return "\n".join(_call_json(c, "parameters") for c in calls)
    written = [{"name": c.name, "arguments": _arguments(c)} for c in calls]
    return json.dumps({"tool_calls": written}, ensure_ascii=False)


def template_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """An assistant's earlier calls as a chat template reads them from its message's
    `tool_calls`: OpenAI's shape, with the arguments as an object (as templates expect)."""
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": _arguments(c)},
        }
        for c in calls
    ]


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as JSON; those the model could not have written stay as sent."""
    try:
        return json_value(call.arguments or "{}")
    except ValueError:
        return call.arguments


def _call_json(call: ToolCall, arguments: str) -> str:
    return json.dumps({"name": call.name, arguments: _arguments(call)}, ensure_ascii=False)


def _laid_out(schema: Any) -> str:
    """A schema to embed in a grammar, laid out by JSON_LAYOUT unless it says otherwise."""
    if isinstance(schema, dict):
        schema = {"x-guidance": JSON_LAYOUT, **schema}
    return json.dumps(schema)


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
