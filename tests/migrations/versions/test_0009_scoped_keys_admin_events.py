"""Migration 0009: keys made before it keep working with every scope; the outbox takes
admin events beside run events, each row naming exactly one; downgrade takes it away."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from alembic import command

from services.core import migrate


def test_keys_keep_every_scope_and_outbox_rows_name_one_event(
    database_at: Callable[[str], str],
) -> None:
    url = database_at("0008")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO tenants (tenant_id, name, weight, max_kv_blocks,"
                    " max_concurrent_runs) VALUES ('t-1', 'acme', 1, 0, 0)"
                )
            )
            conn.execute(
                sa.text(
                    "INSERT INTO api_keys (key_id, tenant_id, secret_hash)"
                    " VALUES ('k-1', 't-1', 'h')"
                )
            )
        migrate.upgrade(url)
        with engine.begin() as conn:
            key = conn.execute(sa.text("SELECT * FROM api_keys")).one()._mapping
            assert (key["alias"], key["allowed_models"], key["expires_at"]) == ("", None, None)
            conn.execute(
                sa.text(
                    "INSERT INTO admin_events (event_id, type, tenant_id, subject, actor)"
                    " VALUES ('adm_1', 'quota.set', 't-1', 't-1', 'admin')"
                )
            )
            conn.execute(sa.text("INSERT INTO outbox (admin_event_id) VALUES ('adm_1')"))
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO outbox (run_id) VALUES ('r-1')"))

        command.downgrade(migrate.alembic_config(url), "0008")
        with engine.begin() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 0
        assert "admin_events" not in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()
