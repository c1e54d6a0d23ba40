"""Scoped API keys, and admin audit events through the outbox.

`api_keys` gains what a key may do (`allowed_models`, NULL = every model), until when
(`expires_at`), a name (`alias`), when it was last used (`last_used_at`, written in
batches) and the secret a rotation replaced, with until when it still works.

`admin_events` records every change to a tenant, key or quota; its outbox row, written in
the same transaction, has the relay publish it to `tollgate.admin-events.v1`. An outbox
row now names either a run event (`run_id`, `seq`) or an admin event (`admin_event_id`).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

NOW = sa.text("clock_timestamp()")


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("alias", sa.Text, nullable=False, server_default=""))
    op.add_column("api_keys", sa.Column("allowed_models", ARRAY(sa.Text)))
    op.add_column("api_keys", sa.Column("expires_at", sa.DateTime(timezone=True)))
    op.add_column("api_keys", sa.Column("last_used_at", sa.DateTime(timezone=True)))
    op.add_column("api_keys", sa.Column("previous_secret_hash", sa.Text))
    op.add_column("api_keys", sa.Column("previous_secret_expires_at", sa.DateTime(timezone=True)))
    op.create_index("api_keys_tenant", "api_keys", ["tenant_id", "created_at", "key_id"])
    op.create_table(
        "admin_events",
        sa.Column("event_id", sa.Text, primary_key=True),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("before", JSONB),
        sa.Column("after", JSONB),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    op.alter_column("outbox", "run_id", nullable=True)
    op.alter_column("outbox", "seq", nullable=True)
    op.add_column(
        "outbox",
        sa.Column("admin_event_id", sa.Text, sa.ForeignKey("admin_events.event_id")),
    )
    op.create_check_constraint(
        "outbox_names_one_event",
        "outbox",
        "(run_id IS NOT NULL AND seq IS NOT NULL AND admin_event_id IS NULL)"
        " OR (run_id IS NULL AND seq IS NULL AND admin_event_id IS NOT NULL)",
    )


def downgrade() -> None:
    op.execute("DELETE FROM outbox WHERE admin_event_id IS NOT NULL")
    op.drop_constraint("outbox_names_one_event", "outbox")
    op.drop_column("outbox", "admin_event_id")
    op.alter_column("outbox", "seq", nullable=False)
    op.alter_column("outbox", "run_id", nullable=False)
    op.drop_table("admin_events")
    op.drop_index("api_keys_tenant", "api_keys")
    for column in (
        "previous_secret_expires_at",
        "previous_secret_hash",
        "last_used_at",
        "expires_at",
        "allowed_models",
        "alias",
    ):
        op.drop_column("api_keys", column)
