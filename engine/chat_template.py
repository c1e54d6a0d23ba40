"""Rendering Hugging Face chat templates with a sandboxed Jinja environment."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import EngineError


class ChatTemplateError(EngineError):
    """The chat template is missing, or rejected the messages."""


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra: Any,
) -> str:
    """Render `messages` the way `transformers`' `apply_chat_template(tokenize=False)` does."""
    try:
        return _compile(template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **extra,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    # Templates expect non-ASCII text kept as is, unlike Jinja's HTML-safe built-in filter.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(message)
