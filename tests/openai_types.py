"""Checks of answers against the `openai` SDK's own types: each parses, and nothing in it
is a field the SDK does not know (its models keep unknown fields as extras)."""

from __future__ import annotations

from typing import Any

from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def unknown_fields(model: Any, path: str = "") -> list[str]:
    """The paths of the fields the SDK's models held as extras, recursively."""
    if isinstance(model, list):
        return [p for i, m in enumerate(model) for p in unknown_fields(m, f"{path}[{i}]")]
    if not isinstance(model, BaseModel):
        return []
    found = [f"{path}.{name}" for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        found += unknown_fields(getattr(model, name), f"{path}.{name}")
    return found


def parse_event(data: dict[str, Any]) -> Any:
    """The SDK's typed event for `data`; fails on a field it lacks or does not know."""
    event = EVENTS.validate_python(data)
    assert type(event).__name__ != "dict", data
    assert unknown_fields(event) == [], (data["type"], unknown_fields(event))
    return event


def parse_response(data: dict[str, Any]) -> Response:
    response = Response.model_validate(data)
    assert unknown_fields(response) == [], unknown_fields(response)
    return response
