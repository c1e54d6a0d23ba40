"""The benchmarks' `--model`: the real model where it is cached, or a random Llama.

`--model smollm2-135m-instruct` (or any name, `.gguf` file or model directory that
`tollgate up --model` takes) measures that model; `--model 56m` and `--model tiny` generate a
random Llama of a fixed shape, seeded, so that a figure does not depend on what a user has
fetched. Without `--model`, a benchmark measures the real model when `tollgate models fetch`
has put it in the cache, and the 56M random Llama otherwise.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.report import progress
from bench.workload import MODEL_SHAPE
from engine.model_dirs.fetch import fetched_dir, resolve_model
from engine.model_dirs.registry import KNOWN_MODELS, model_cache
from engine.model_dirs.tiny import init_tiny_model

REAL_MODEL = "smollm2-135m-instruct"
SYNTHETIC: dict[str, dict[str, Any]] = {
    # Engine steps, not the engine's Python, dominate a run on this one.
    "56m": MODEL_SHAPE,
    # Steps cost little more than the engine's Python, so the services' own cost shows.
    "tiny": {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "vocab": 512},
}
DEFAULT_SYNTHETIC = "56m"


def default_model() -> str:
    """The real model when it is fetched, else the 56M random Llama."""
    return REAL_MODEL if fetched_dir(KNOWN_MODELS[REAL_MODEL], model_cache()) else "56m"


def add_model_option(parser: argparse.ArgumentParser, synthetic: Iterable[str] = ("56m",)) -> None:
    shapes = ", ".join(f"`{name}`" for name in synthetic)
    parser.add_argument(
        "--model",
        default=None,
        help=f"a model name, .gguf file or model directory, or {shapes} for a random Llama"
        f" (default: {REAL_MODEL} when fetched, else {DEFAULT_SYNTHETIC})",
    )


def model_name(spec: str | None) -> str:
    return spec or default_model()


def model_dir(spec: str | None, scratch: Path) -> Path:
    """The directory of the model `spec` names, generating a random one under `scratch`."""
    name = model_name(spec)
    if name in SYNTHETIC:
        progress(f"generating the {name} random model")
        return init_tiny_model(scratch / f"model-{name}", **SYNTHETIC[name])
    return resolve_model(name, progress=progress)[1]
