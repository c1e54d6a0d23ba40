"""The shapes OpenAI's and Anthropic's bodies give an answer's format and tools, as
admission's `Structure` (no I/O); what is malformed in them goes to a list of field
violations, what they say is checked with the rest of the request."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.structure import FunctionTool, Structure
from services.core.errors import FieldViolation


def structure_names(
    format_type: str, format_schema: str, function_of: str, num_tools: int
) -> dict[str, str]:
    """OpenAI's names for the `Structure` fields: the format's type and schema, and each
    tool's function fields under `tools[i].` + `function_of`."""
    names = {
        "sampling.response_format.type": format_type,
        "sampling.response_format.json_schema": format_schema,
        "sampling.tools": "tools",
        "sampling.tool_choice.mode": "tool_choice",
        "sampling.tool_choice.function": "tool_choice",
    }
    for i in range(num_tools):
        for name in ("name", "parameters"):
            names[f"sampling.tools[{i}].{name}"] = f"tools[{i}].{function_of}{name}"
    return names


def structure_of(
    response_format_json: dict[str, Any] | None,
    tools_json: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    found: list[FieldViolation],
) -> Structure:
    """OpenAI's chat response_format, tools and tool_choice as admission's Structure; what
    is malformed in their shapes goes to `found` (what they say is checked with the rest)."""
    response_format, json_schema = "text", ""
    if response_format_json is not None:
        response_format = str(response_format_json.get("type"))
        if response_format == "json_schema":
            spec = response_format_json.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict | bool):
                found.append(FieldViolation("response_format.json_schema", "give its schema"))
            json_schema = json.dumps(schema)
    tools = []
    for i, tool in enumerate(tools_json or ()):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            found.append(FieldViolation(f"tools[{i}].type", "only function tools are supported"))
            continue
        tools.append(function_tool(function, "parameters"))
    mode, function_name = "auto" if tools_json else "none", ""
    if isinstance(tool_choice, str):
        mode = tool_choice
    elif isinstance(tool_choice, dict):
        named = tool_choice.get("function")
        mode = "function"
        function_name = str(named.get("name", "")) if isinstance(named, dict) else ""
    return Structure(
        response_format=response_format,
        json_schema=json_schema,
        tools=tuple(tools),
        tool_choice=mode,
        function=function_name,
        parallel_tool_calls=parallel_tool_calls is not False,
        tool_format="",  # the model's own, chosen by the gateway
    )


def function_tool(spec: Mapping[str, Any], schema_field: str) -> FunctionTool:
    """A tool's name, description and the JSON schema of its arguments (`spec[schema_field]`)."""
    schema = spec.get(schema_field)
    return FunctionTool(
        str(spec.get("name", "")),
        str(spec.get("description") or ""),
        "" if schema is None else json.dumps(schema),
    )
