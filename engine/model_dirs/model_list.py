"""`tollgate models list`: the models that can be fetched and the directories in the cache,
LoRA adapters among them with their base."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.adapters import ADAPTER_CONFIG
from engine.errors import ModelLoadError
from engine.model_dirs.fetch import fetched_dir
from engine.model_dirs.registry import KnownModel
from engine.model_files import read_json


@dataclass(frozen=True, slots=True)
class CachedModel:
    """A model directory in the cache; `fetched` when it is a known model's whole fetch.
    `base` is an adapter's base model (as its config names it); "" for a model."""

    name: str
    path: str
    num_bytes: int
    fetched: bool
    base: str = ""


def cached_models(root: Path, known: dict[str, KnownModel]) -> list[CachedModel]:
    """The directories under `root`; staging directories (hidden) are left out."""
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.name.startswith("."):
            model = known.get(path.name)
            fetched = model is not None and fetched_dir(model, root) is not None
            found.append(
                CachedModel(path.name, str(path), _num_bytes(path), fetched, _adapter_base(path))
            )
    return found


def _adapter_base(path: Path) -> str:
    if not (path / ADAPTER_CONFIG).is_file():
        return ""
    try:
        base = read_json(path / ADAPTER_CONFIG).get("base_model_name_or_path")
    except ModelLoadError:
        return "?"
    return Path(str(base)).name if base else "?"


def _num_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def listing_json(root: Path, known: dict[str, KnownModel]) -> str:
    cached = cached_models(root, known)
    fetched = {entry.name for entry in cached if entry.fetched}
    document = {
        "cache": str(root),
        "fetchable": [
            {**asdict(model), "fetched": model.name in fetched} for model in known.values()
        ],
        "cached": [asdict(entry) for entry in cached],
    }
    return json.dumps(document, indent=2)


def listing_text(root: Path, known: dict[str, KnownModel]) -> str:
    cached = cached_models(root, known)
    fetched = {entry.name for entry in cached if entry.fetched}
    lines = ["fetchable (tollgate models fetch NAME):"]
    for model in known.values():
        mark = "  [fetched]" if model.name in fetched else ""
        lines.append(f"  {model.name}  {model.requirement}  {model.description}{mark}")
    lines.append(f"cached in {root}:")
    lines.extend(
        f"  {entry.name}  {_size(entry.num_bytes)}  {entry.path}{_note(entry)}" for entry in cached
    )
    if not cached:
        lines.append("  (none)")
    return "\n".join(lines)


def _note(entry: CachedModel) -> str:
    if entry.base:
        return f"  (LoRA adapter of {entry.base})"
    return "" if entry.fetched else "  (not a fetched model)"


def _size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "kB", "MB"):
        if size < 1000:
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"
