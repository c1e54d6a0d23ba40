"""Migration 0005 adds `dead_letters`, whose rows name stored run events, and takes it away."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from alembic import command

from services.core import migrate


@pytest.fixture
def database_at_0004(database_at: Callable[[str], str]) -> str:
    return database_at("0004")


def _insert_run(conn: sa.Connection) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO runs (run_id, tenant_id, model, priority, state, last_seq)"
            " VALUES ('r-1', 't-1', 'tiny', 'interactive', 'queued', 1)"
        )
    )
    conn.execute(
        sa.text(
            "INSERT INTO run_events (run_id, seq, kind, tenant_id, payload)"
            " VALUES ('r-1', 1, 'queued', 't-1', '{}')"
        )
    )


def _tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def test_upgrade_adds_dead_letters_of_stored_events_and_downgrade_drops_it(
    database_at_0004: str,
) -> None:
    engine = sa.create_engine(database_at_0004)
    try:
        with engine.begin() as conn:
            _insert_run(conn)
        assert "dead_letters" not in _tables(engine)

        migrate.upgrade(database_at_0004)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO dead_letters (run_id, seq, error)"
                    " VALUES ('r-1', 1, 'MessageSizeTooLargeError()')"
                )
            )
            row = conn.execute(sa.text("SELECT run_id, seq, error, created_at FROM dead_letters"))
            [(run_id, seq, error, created_at)] = row.all()
        assert (run_id, seq, error) == ("r-1", 1, "MessageSizeTooLargeError()")
        assert created_at is not None
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO dead_letters (run_id, seq, error) VALUES ('r-1', 2, 'x')")
            )

        command.downgrade(migrate.alembic_config(database_at_0004), "0004")
        assert "dead_letters" not in _tables(engine)
    finally:
        engine.dispose()
