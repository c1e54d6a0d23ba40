"""`tollgate up --model`: what it accepts, and a clear refusal of anything else."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from services.stack.cli import ensure_model
from tests.engine.gguf_files import write_gguf


def test_a_gguf_file_is_served_converted_under_its_stem(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOLLGATE_MODEL_CACHE", str(tmp_path / "cache"))
    gguf = write_gguf(tiny_model_dir, tmp_path / "little.gguf")
    args = argparse.Namespace(model=str(gguf), model_name=None)
    name, model_dir = ensure_model(args, tmp_path / "data")
    assert name == "little"
    assert model_dir.parent == tmp_path / "cache" and (model_dir / "config.json").is_file()
    renamed = argparse.Namespace(model=str(gguf), model_name="chosen")
    assert ensure_model(renamed, tmp_path / "data") == ("chosen", model_dir)


def test_a_directory_is_served_under_its_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = argparse.Namespace(model=str(tiny_model_dir), model_name=None)
    assert ensure_model(args, tmp_path) == (tiny_model_dir.name, tiny_model_dir.resolve())


def test_an_unknown_model_ends_up_at_once_naming_it(tmp_path: Path) -> None:
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "tollgate.cli",
            "up",
            "--data-dir",
            str(tmp_path),
            "--model",
            "nope",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert up.returncode == 1
    assert "nope: not a model directory, a .gguf file or a known model" in up.stderr
    assert not (tmp_path / "infra").exists()  # nothing was started
