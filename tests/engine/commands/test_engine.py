"""`tollgate engine generate`: a model's completion of one prompt, as text or JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tollgate.cli import main


def test_init_tiny_then_generate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "m"
    assert (
        main(
            [
                "models",
                "init-tiny",
                str(model_dir),
                "--layers",
                "1",
                "--hidden",
                "32",
                "--heads",
                "2",
                "--kv-heads",
                "1",
                "--vocab",
                "300",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        1,
        32,
        300,
    )
    capsys.readouterr()
    argv = [
        "engine",
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "the toll gate",
        "--max-tokens",
        "7",
        "--ignore-eos",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) == 7 and isinstance(result["text"], str)
    assert main(argv[:-1]) == 0  # streamed text is the same greedy completion
    assert capsys.readouterr().out == result["text"] + "\n"


def test_generate_with_sampling_flags_and_chat(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "engine",
        "generate",
        "--model",
        str(tiny_dir),
        "--prompt",
        "hi",
        "--chat",
        "--temperature",
        "0.8",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
        "--seed",
        "5",
        "--max-tokens",
        "5",
        "--json",
    ]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first


def test_generate_reports_a_bad_model_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["engine", "generate", "--model", str(tmp_path), "--prompt", "x"]) == 1
    assert "config.json" in capsys.readouterr().err


def test_generate_with_int8_weights_and_a_bf16_cache(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["engine", "generate", "--model", str(tiny_dir), "--prompt", "hi"]
    flags = ["--max-tokens", "6", "--ignore-eos", "--json"]
    assert main([*argv, *flags, "--quantization", "int8", "--kv-dtype", "bfloat16"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 6


def test_generate_rejects_an_unknown_quantization(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "engine",
                "generate",
                "--model",
                str(tiny_dir),
                "--prompt",
                "x",
                "--quantization",
                "int4",
            ]
        )
    assert exit_info.value.code == 2
    assert "--quantization" in capsys.readouterr().err
