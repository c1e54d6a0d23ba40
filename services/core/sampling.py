"""A request's response format and tools between the `SamplingParams` message, its JSON
form in the stored `queued` event, and `engine.structure.Structure` (no I/O): admission
reads them from clients and stores them, the worker reads them back for its engine."""

from __future__ import annotations

from typing import Any

from engine.structure import FunctionTool, Structure
from tollgate.v1 import events_pb2


def structure_from_proto(s: events_pb2.SamplingParams) -> Structure:
    """The structure as sent or stored. An unset `tool_format` stays "": admission then
    chooses the model's own and stores it; a worker reading "" from a stored run writes
    the generic format, as the engine does with ""."""
    return Structure(
        response_format=s.response_format.type or "text",
        json_schema=s.response_format.json_schema,
        tools=tuple(FunctionTool(t.name, t.description, t.parameters) for t in s.tools),
        tool_choice=s.tool_choice.mode or "auto",
        function=s.tool_choice.function,
        parallel_tool_calls=s.parallel_tool_calls if s.HasField("parallel_tool_calls") else True,
        tool_format=s.tool_format,
    )


def structure_payload(structure: Structure) -> dict[str, Any]:
    """The fields `structure` sets in the JSON form of `SamplingParams`; {} for free text."""
    payload: dict[str, Any] = {}
    if structure.response_format != "text":
        payload["response_format"] = {"type": structure.response_format}
        if structure.json_schema:
            payload["response_format"]["json_schema"] = structure.json_schema
    if structure.tools:
        payload["tools"] = [
            {
                k: v
                for k, v in (
                    ("name", t.name),
                    ("description", t.description),
                    ("parameters", t.parameters),
                )
                if v
            }
            for t in structure.tools
        ]
    if structure.tool_choice != "auto":
        payload["tool_choice"] = {"mode": structure.tool_choice}
        if structure.function:
            payload["tool_choice"]["function"] = structure.function
    if not structure.parallel_tool_calls:
        payload["parallel_tool_calls"] = False
    if structure.tool_format not in ("", "generic"):
        payload["tool_format"] = structure.tool_format
    return payload
