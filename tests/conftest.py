"""One PostgreSQL and one Kafka-protocol broker for the whole session.

Both come from `LocalInfra`, so TOLLGATE_DATABASE_URL and TOLLGATE_KAFKA_BOOTSTRAP
point the suite at external servers instead. Each test that asks gets its own
migrated database and its own topic.
"""

from __future__ import annotations

import os

# Some tests start servers with a preexec_fn (PostgreSQL as its own user, `tollgate infra
# up`) from this process, whose gRPC clients have threads running by then. gRPC's fork
# support would restart its poller in the forked child, which can abort there before
# exec. Nothing here forks to keep using gRPC in the child. Read when gRPC loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.core import migrate
from services.core.kafka import ensure_topics
from services.stack.infra import (
    Endpoints,
    LocalInfra,
    create_database,
    create_database_from_template,
    drop_database,
)

TEMPLATE_DATABASE = "tollgate_template"
TOPIC_PARTITIONS = 4


@pytest.fixture(scope="session")
def infra() -> Iterator[Endpoints]:
    # Not under pytest's basetemp: a concurrent pytest run prunes old basetemps,
    # which would pull the data directory from under a running server.
    with tempfile.TemporaryDirectory(prefix="tollgate-test-infra-") as data_dir:
        with LocalInfra(Path(data_dir)) as endpoints:
            yield endpoints


@pytest.fixture(scope="session")
def template_database(infra: Endpoints) -> Iterator[str]:
    # Migrating once and copying per test is far faster than migrating per test.
    drop_database(infra.database_url, TEMPLATE_DATABASE)
    migrate.upgrade(create_database(infra.database_url, TEMPLATE_DATABASE))
    yield TEMPLATE_DATABASE
    drop_database(infra.database_url, TEMPLATE_DATABASE)


@pytest.fixture
def database_url(infra: Endpoints, template_database: str) -> Iterator[str]:
    """A fresh migrated database for this test alone, dropped afterwards."""
    name = f"test_{uuid.uuid4().hex}"
    yield create_database_from_template(infra.database_url, template_database, name)
    drop_database(infra.database_url, name)


@pytest.fixture
def kafka_bootstrap(infra: Endpoints) -> str:
    return infra.kafka_bootstrap


@pytest.fixture
def kafka_topic(kafka_bootstrap: str) -> str:
    """A new topic for this test alone, with four partitions."""
    name = f"test-{uuid.uuid4()}"
    ensure_topics(kafka_bootstrap, [name], TOPIC_PARTITIONS)
    return name


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated tiny Llama model in Hugging Face format, shared by the session."""
    from engine.model_dirs.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("tiny-model"))
