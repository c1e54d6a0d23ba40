"""The models admission serves: name → tokenizer and context length."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.chat_template import ChatTemplateError
from engine.loader import load_model_config
from engine.tokenizer import Tokenizer
from services.admission.requests import GenerateParams
from services.core.errors import FieldViolation, InvalidArgument

# How much of a chat template's complaint a client is told.
MAX_TEMPLATE_ERROR = 200


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    tokenizer: Tokenizer
    context_length: int
    vocab_size: int

    def prompt_token_ids(self, params: GenerateParams) -> list[int]:
        """Raises InvalidArgument naming `messages` when the model has no chat template,
        or its template refuses them."""
        if not params.messages:
            return self.tokenizer.encode(params.prompt)
        messages = [{"role": role, "content": content} for role, content in params.messages]
        try:
            return self.tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            description = str(exc)[:MAX_TEMPLATE_ERROR]
            raise InvalidArgument([FieldViolation("messages", description)]) from None


class ModelCatalog:
    def __init__(self, entries: Mapping[str, ModelEntry]) -> None:
        self.entries = dict(entries)

    @classmethod
    def load(cls, model_dirs: Mapping[str, str]) -> ModelCatalog:
        entries = {}
        for name, directory in model_dirs.items():
            config = load_model_config(Path(directory))
            entries[name] = ModelEntry(
                name=name,
                tokenizer=Tokenizer.from_model_dir(directory),
                context_length=config.max_position_embeddings,
                vocab_size=config.vocab_size,
            )
        return cls(entries)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> ModelEntry:
        return self.entries[name]
