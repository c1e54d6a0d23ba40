from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_dirs.tiny import init_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def make_engine(tiny_dir: Path) -> Callable[..., LLMEngine]:
    """A fresh engine over the shared tiny model, with a small pool unless told otherwise."""

    def make(**overrides: object) -> LLMEngine:
        settings: dict[str, object] = {
            "num_kv_blocks": 256,
            "block_size": 4,
            "max_num_batched_tokens": 64,
        }
        settings.update(overrides)
        return LLMEngine.from_model_dir(tiny_dir, EngineConfig(**settings))  # type: ignore[arg-type]

    return make
