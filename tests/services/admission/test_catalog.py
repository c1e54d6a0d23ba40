"""The model catalog: adapters are models of their own name on their base's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.model_dirs.adapter_init import init_adapter
from engine.model_dirs.tiny import init_tiny_model
from services.admission.catalog import ModelCatalog
from services.core.auth import Principal
from services.core.config import ConfigError


def test_an_adapter_is_listed_with_its_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = init_tiny_model(tmp_path / "other", seed=4)
    adapter = init_adapter(tmp_path / "sql", tiny_model_dir, rank=2)
    catalog = ModelCatalog.load(
        {"tiny": str(tiny_model_dir), "other": str(other)}, {"tiny-sql": str(adapter)}
    )
    assert catalog.names() == ["other", "tiny", "tiny-sql"]
    entry = catalog.get("tiny-sql")
    assert (entry.parent, catalog.get("tiny").parent) == ("tiny", "")
    assert entry.tokenizer is catalog.get("tiny").tokenizer
    assert entry.context_length == catalog.get("tiny").context_length


def test_a_key_sees_only_the_models_it_may_use(tiny_model_dir: Path, tmp_path: Path) -> None:
    adapter = init_adapter(tmp_path / "sql", tiny_model_dir, rank=2)
    catalog = ModelCatalog.load({"tiny": str(tiny_model_dir)}, {"tiny-sql": str(adapter)})
    anyone, scoped = Principal("t1"), Principal("t1", allowed_models=frozenset({"tiny-sql"}))
    assert [e.name for e in catalog.usable_by(anyone)] == ["tiny", "tiny-sql"]
    assert [(e.name, e.parent) for e in catalog.usable_by(scoped)] == [("tiny-sql", "tiny")]
    assert catalog.find(scoped, "tiny-sql") is catalog.get("tiny-sql")
    assert catalog.find(scoped, "tiny") is None and catalog.find(anyone, "nope") is None


def test_an_adapter_whose_base_is_not_served_is_a_configuration_error(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = init_tiny_model(tmp_path / "other", seed=4)
    adapter = init_adapter(tmp_path / "sql", tiny_model_dir, rank=2)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "elsewhere")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    models = {"tiny": str(tiny_model_dir), "other": str(other)}
    with pytest.raises(ConfigError, match=r"TOLLGATE_ADAPTERS\['tiny-sql'\]"):
        ModelCatalog.load(models, {"tiny-sql": str(adapter)})
    with pytest.raises(ConfigError, match="already a model's name"):
        ModelCatalog.load(models, {"other": str(adapter)})
    # With a single base model, that is the base.
    assert ModelCatalog.load({"tiny": str(tiny_model_dir)}, {"s": str(adapter)}).get("s").parent
