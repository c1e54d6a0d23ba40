"""Migration 0004 renames a run's reserved KV blocks to `num_kv_blocks`, and back."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from alembic import command

from services.core import migrate

# What a `queued` event stored before 0004: a stop sequence that quotes the old key
# and holds U+0000, which the rewrite must leave as it is.
OLD_QUEUED = {
    "model": "tiny",
    "sampling": {"max_tokens": 8, "stop": ['"kv_blocks_reserved": 9', "\x00"]},
    "prompt_token_ids": [1, 2, 3],
    "kv_blocks_reserved": 7,
}
STREAMING = {"token_ids": [4], "text": '{"kv_blocks_reserved": 5}\x00'}


@pytest.fixture
def database_at_0003(database_at: Callable[[str], str]) -> str:
    return database_at("0003")


def _insert_old_run(conn: sa.Connection) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO runs (run_id, tenant_id, model, priority, state, last_seq)"
            " VALUES ('r-1', 't-1', 'tiny', 'interactive', 'streaming', 2)"
        )
    )
    conn.execute(
        sa.text(
            "INSERT INTO run_events (run_id, seq, kind, tenant_id, payload)"
            " VALUES ('r-1', 1, 'queued', 't-1', CAST(:queued AS json)),"
            " ('r-1', 2, 'streaming', 't-1', CAST(:streaming AS json))"
        ),
        {"queued": json.dumps(OLD_QUEUED), "streaming": json.dumps(STREAMING)},
    )
    conn.execute(
        sa.text(
            "INSERT INTO kv_reservations (run_id, tenant_id, num_blocks) VALUES ('r-1', 't-1', 7)"
        )
    )


def _payload_texts(conn: sa.Connection) -> list[str]:
    query = "SELECT payload::text FROM run_events WHERE run_id = 'r-1' ORDER BY seq"
    return list(conn.execute(sa.text(query)).scalars())


def _reserved_blocks(conn: sa.Connection, column: str) -> int:
    query = f"SELECT {column} FROM kv_reservations WHERE run_id = 'r-1'"
    return int(conn.execute(sa.text(query)).scalar_one())


def test_upgrade_renames_the_column_and_the_queued_key_and_downgrade_restores_them(
    database_at_0003: str,
) -> None:
    engine = sa.create_engine(database_at_0003)
    config = migrate.alembic_config(database_at_0003)
    try:
        with engine.begin() as conn:
            _insert_old_run(conn)
            old_texts = _payload_texts(conn)

        migrate.upgrade(database_at_0003)
        with engine.connect() as conn:
            queued_text, streaming_text = _payload_texts(conn)
            assert _reserved_blocks(conn, "num_kv_blocks") == 7
        new_queued = {**OLD_QUEUED, "num_kv_blocks": 7}
        del new_queued["kv_blocks_reserved"]
        assert json.loads(queued_text) == new_queued
        assert streaming_text == old_texts[1]

        command.downgrade(config, "0003")
        with engine.connect() as conn:
            assert _payload_texts(conn) == old_texts
            assert _reserved_blocks(conn, "num_blocks") == 7
    finally:
        engine.dispose()
