"""The models admission serves: name → tokenizer and context length. A LoRA adapter is a
model of its own name that runs on its base model (`parent`) and shares its tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.adapters import read_adapter_config
from engine.chat_template import ChatTemplateError
from engine.errors import ModelLoadError
from engine.loader import load_model_config
from engine.structure import (
    TEMPLATE_FORMATS,
    Structure,
    calls_text,
    template_calls,
    tool_format_of,
)
from engine.tokenizer import Tokenizer
from services.admission.requests import ChatTurn, GenerateParams
from services.core.auth import Principal
from services.core.config import ConfigError
from services.core.errors import FieldViolation, InvalidArgument

# How much of a chat template's complaint a client is told.
MAX_TEMPLATE_ERROR = 200


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    tokenizer: Tokenizer
    context_length: int
    vocab_size: int
    parent: str = ""  # an adapter's base model; "" for a base model

    @property
    def tool_format(self) -> str:
        """The tool format its chat template teaches it (engine.structure.TOOL_FORMATS)."""
        return tool_format_of(self.tokenizer.chat_template)

    def prompt_token_ids(self, params: GenerateParams) -> list[int]:
        """Raises InvalidArgument naming `messages` when the model has no chat template,
        or its template refuses them."""
        if not params.messages:
            return self.tokenizer.encode(params.prompt)
        structure = params.sampling.structure
        messages = chat_messages(params.messages, structure)
        try:
            return self.tokenizer.encode_chat(messages, tools=structure.template_tools())
        except ChatTemplateError as exc:
            description = str(exc)[:MAX_TEMPLATE_ERROR]
            raise InvalidArgument([FieldViolation("messages", description)]) from None


def chat_messages(turns: Sequence[ChatTurn], structure: Structure) -> list[dict[str, Any]]:
    """The messages for the chat template in the structure's tool format.

    Generic: the tools in the system turn, an assistant's earlier calls as the JSON it
    would have written. A template that shows tools itself (hermes, llama3) is given them
    apart (`Structure.template_tools`), an assistant's earlier calls as OpenAI's
    `tool_calls`, and each tool's answer with the id (and function name) of its call."""
    if structure.tool_format in TEMPLATE_FORMATS:
        return _template_messages(turns)
    messages: list[dict[str, Any]] = [{"role": t.role, "content": _turn_text(t)} for t in turns]
    tools = structure.system_prompt()
    if tools and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{tools}"
    elif tools:
        messages.insert(0, {"role": "system", "content": tools})
    return messages


def _turn_text(turn: ChatTurn) -> str:
    if not turn.tool_calls:
        return turn.content
    calls = calls_text(turn.tool_calls)
    return f"{turn.content}\n{calls}" if turn.content else calls


def _template_messages(turns: Sequence[ChatTurn]) -> list[dict[str, Any]]:
    # Templates tell a plain assistant turn by its lacking `tool_calls`, so only a turn
    # with calls has them.
    names = {call.id: call.name for turn in turns for call in turn.tool_calls}
    messages = []
    for turn in turns:
        message: dict[str, Any] = {"role": turn.role, "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = template_calls(turn.tool_calls)
        if turn.tool_call_id:
            message["tool_call_id"] = turn.tool_call_id
            if turn.tool_call_id in names:
                message["name"] = names[turn.tool_call_id]
        messages.append(message)
    return messages


class ModelCatalog:
    def __init__(self, entries: Mapping[str, ModelEntry]) -> None:
        self.entries = dict(entries)

    @classmethod
    def load(
        cls, model_dirs: Mapping[str, str], adapter_dirs: Mapping[str, str] | None = None
    ) -> ModelCatalog:
        """Base models by directory, then adapters (name -> PEFT directory), each on the
        base its `base_model_name_or_path` names, or on the only base model there is."""
        entries = {}
        for name, directory in model_dirs.items():
            config = load_model_config(Path(directory))
            entries[name] = ModelEntry(
                name=name,
                tokenizer=Tokenizer.from_model_dir(directory),
                context_length=config.max_position_embeddings,
                vocab_size=config.vocab_size,
            )
        for name, directory in (adapter_dirs or {}).items():
            if name in entries:
                raise ConfigError(f"TOLLGATE_ADAPTERS: {name!r} is already a model's name")
            base = entries[adapter_base(name, Path(directory), model_dirs)]
            entries[name] = replace(base, name=name, parent=base.name)
        return cls(entries)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def with_tool_format(self, params: GenerateParams) -> GenerateParams:
        """`params` with an unset tool format chosen: the model's own, for a request with
        tools. One without tools, or for a model not served, is left as it is, so that
        what it stores and hashes to does not change."""
        structure = params.sampling.structure
        entry = self.entries.get(params.model)
        if structure.tool_format or not structure.tools or entry is None:
            return params
        structure = replace(structure, tool_format=entry.tool_format)
        return replace(params, sampling=replace(params.sampling, structure=structure))

    def get(self, name: str) -> ModelEntry:
        return self.entries[name]

    def usable_by(self, principal: Principal) -> list[ModelEntry]:
        """The models the caller's key may use, by name: both fronts' model lists."""
        return [self.entries[name] for name in self.names() if principal.may_use(name)]

    def find(self, principal: Principal, name: str) -> ModelEntry | None:
        """The model `name` if it exists and the caller's key may use it."""
        entry = self.entries.get(name)
        return entry if entry is not None and principal.may_use(name) else None


def adapter_base(name: str, directory: Path, model_dirs: Mapping[str, str]) -> str:
    """The name of the base model an adapter was made for; raises ConfigError."""
    try:
        declared = str(read_adapter_config(directory).get("base_model_name_or_path") or "")
    except ModelLoadError as exc:
        raise ConfigError(f"TOLLGATE_ADAPTERS[{name!r}]: {exc}") from None
    by_dir = {Path(d).resolve(): model for model, d in model_dirs.items()}
    if declared and Path(declared).resolve() in by_dir:
        return by_dir[Path(declared).resolve()]
    if declared in model_dirs:
        return declared
    if len(model_dirs) == 1:
        return next(iter(model_dirs))
    raise ConfigError(
        f"TOLLGATE_ADAPTERS[{name!r}]: its base {declared!r} is none of TOLLGATE_MODELS"
    )
