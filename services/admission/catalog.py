"""The models admission serves: name → tokenizer and context length."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.loader import load_model_config
from engine.tokenizer import Tokenizer
from services.admission.requests import GenerateParams


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    tokenizer: Tokenizer
    context_length: int

    def prompt_token_ids(self, params: GenerateParams) -> list[int]:
        if params.messages:
            messages = [{"role": role, "content": content} for role, content in params.messages]
            return self.tokenizer.encode_chat(messages)
        return self.tokenizer.encode(params.prompt)


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
            )
        return cls(entries)

    def names(self) -> list[str]:
        return sorted(self.entries)

    def get(self, name: str) -> ModelEntry:
        return self.entries[name]
