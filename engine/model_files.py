"""Reading a Hugging Face model directory: required files, JSON, fingerprints."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# Bytes sampled from each weight file: enough to tell fine-tunes of one base apart
# without reading gigabytes at start-up.
_SAMPLES_PER_FILE = 16
_SAMPLE_BYTES = 1 << 16


def require_file(model_dir: Path, name: str) -> Path:
    path = model_dir / name
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: missing {name}")
    return path


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def read_optional_json(model_dir: Path, name: str) -> dict[str, Any]:
    path = model_dir / name
    return read_json(path) if path.is_file() else {}


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of the model, single or sharded, checked to exist."""
    index = model_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        names = sorted(set(weight_map.values()))
        return [require_file(model_dir, name) for name in names]
    single = model_dir / WEIGHTS_FILE
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(
            f"{model_dir}: no *.safetensors weights (expected {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE})"
        )
    return found


def fingerprint_text(*parts: str | bytes) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def model_fingerprint(model_dir: Path) -> str:
    """A stable identity of config and weights: the config, each file's safetensors header
    and size, and bytes sampled across each file."""
    parts: list[bytes] = [require_file(model_dir, "config.json").read_bytes()]
    for path in weight_files(model_dir):
        parts.append(path.name.encode())
        parts.extend(_sample_file(path))
    return fingerprint_text(*parts)


def _sample_file(path: Path) -> list[bytes]:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        samples = [size.to_bytes(8, "little"), handle.read(min(header_len, size))]
        for i in range(_SAMPLES_PER_FILE):
            handle.seek(size * i // _SAMPLES_PER_FILE, os.SEEK_SET)
            samples.append(handle.read(_SAMPLE_BYTES))
    return samples
