"""`tollgate models adapter-init` and `models list`; fetch and inspect are tested with
their modules (tests/engine/model_dirs/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tollgate.cli import main


def test_adapter_init_writes_a_peft_adapter_that_models_list_shows(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    adapter = cache / "tiny-sql"
    args = ["models", "adapter-init", str(adapter), "--base", str(tiny_dir), "--rank", "4"]
    assert main([*args, "--seed", "2", "--target", "q_proj", "--target", "down_proj"]) == 0
    assert capsys.readouterr().out.strip() == str(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == ["down_proj", "q_proj"]
    assert (adapter / "adapter_model.safetensors").is_file()
    assert main(["models", "list", "--dir", str(cache)]) == 0
    assert f"(LoRA adapter of {tiny_dir.name})" in capsys.readouterr().out
    assert main(["models", "list", "--dir", str(cache), "--json"]) == 0
    [cached] = json.loads(capsys.readouterr().out)["cached"]
    assert (cached["name"], cached["base"]) == ("tiny-sql", tiny_dir.name)
    assert (
        main(["models", "adapter-init", str(adapter), "--base", str(tiny_dir), "--rank", "0"]) == 1
    )
    assert "rank must be positive" in capsys.readouterr().err
