"""Event store: runs projection, run events, outbox, consumer tracking.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

NOW = sa.text("clock_timestamp()")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("priority", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("owner", sa.Text),
        sa.Column("lease_epoch", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("idempotency_key", sa.Text),
        sa.Column("request_hash", sa.Text),
        sa.Column("finish_reason", sa.Text),
        sa.Column("usage", JSONB, nullable=False, server_default="{}"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.UniqueConstraint("tenant_id", "idempotency_key", name="runs_tenant_idempotency_key"),
    )
    op.create_index("runs_tenant_created", "runs", ["tenant_id", "created_at", "run_id"])
    op.create_index("runs_state", "runs", ["state"])
    op.create_table(
        "run_events",
        sa.Column("run_id", sa.Text, sa.ForeignKey("runs.run_id"), primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column("traceparent", sa.Text, nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.CheckConstraint("seq > 0", name="run_events_seq_positive"),
    )
    # Rows wait here until the relay has published them; it deletes what the
    # broker acknowledged, so the table holds only unpublished events.
    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.ForeignKeyConstraint(["run_id", "seq"], ["run_events.run_id", "run_events.seq"]),
    )
    op.create_table(
        "consumer_tracking",
        sa.Column("consumer", sa.Text, primary_key=True),
        sa.Column("run_id", sa.Text, primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )


def downgrade() -> None:
    op.drop_table("consumer_tracking")
    op.drop_table("outbox")
    op.drop_table("run_events")
    op.drop_table("runs")
