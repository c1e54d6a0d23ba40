"""`tollgate up --model`: what it accepts, and a clear refusal of anything else."""

import argparse
import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from services.commands.up import ensure_model, redacted, write_stack_file
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


def _up_parser() -> argparse.ArgumentParser:
    from services.commands.up import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser


def test_each_adapter_is_passed_to_the_services_by_name(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from engine.model_dirs.adapter_init import init_adapter
    from services.commands.up import served_adapters
    from services.stack.launcher import Services, StackConfig

    sql = init_adapter(tmp_path / "sql", tiny_model_dir, rank=2)
    chat = init_adapter(tmp_path / "chat", tiny_model_dir, rank=2, seed=1)
    args = _up_parser().parse_args(
        ["up", "--adapter", f"tiny-sql={sql}", "--adapter", f"tiny-chat={chat}"]
    )
    adapters = served_adapters(args, "tiny")
    assert adapters == {"tiny-sql": sql.resolve(), "tiny-chat": chat.resolve()}
    config = StackConfig("db", "kafka", "tiny", tiny_model_dir, "admin", adapters=adapters)
    env = Services(config, tmp_path / "logs").common_env()
    assert env["TOLLGATE_ADAPTERS"] == f"tiny-sql={sql.resolve()},tiny-chat={chat.resolve()}"
    with pytest.raises(ValueError, match="already taken"):
        served_adapters(_up_parser().parse_args(["up", "--adapter", f"tiny={sql}"]), "tiny")


def test_an_adapter_that_is_not_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _up_parser().parse_args(["up", "--adapter", f"x={tmp_path}"])
    assert "adapter_config.json" in capsys.readouterr().err


def test_the_stack_file_is_private_even_when_it_was_there_before(tmp_path: Path) -> None:
    path = tmp_path / "stack.json"
    for left in (path, path.with_name("stack.json.partial")):
        left.write_text("{}")
        left.chmod(0o644)
    write_stack_file(path, {"admin_token": "secret"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"admin_token": "secret"}


def test_the_printed_stack_hides_its_secrets() -> None:
    url = "postgresql+psycopg://postgres:pw-0123456789@127.0.0.1:5432/tollgate"
    shown = redacted({"admin_token": "t" * 20, "api_key": "k", "database_url": url, "model": "m"})
    assert "t" * 20 not in json.dumps(shown) and "pw-0123456789" not in json.dumps(shown)
    assert shown["database_url"] == "postgresql+psycopg://postgres:***@127.0.0.1:5432/tollgate"
    assert shown["model"] == "m"
