"""Tenants, API keys, KV reservations and the ledger.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

NOW = sa.text("clock_timestamp()")


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("tenant_id", sa.Text, primary_key=True),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("weight", sa.Integer, nullable=False, server_default="1"),
        # 0 = unlimited.
        sa.Column("max_kv_blocks", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("max_concurrent_runs", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.CheckConstraint("weight > 0", name="tenants_weight_positive"),
    )
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.tenant_id"), nullable=False),
        # SHA-256 of the secret; the secret itself is never stored.
        sa.Column("secret_hash", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
    )
    op.create_table(
        "kv_reservations",
        sa.Column("run_id", sa.Text, sa.ForeignKey("runs.run_id"), primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("num_blocks", sa.BigInteger, nullable=False),
        sa.Column("reserved_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        # Set once, by the transaction that bills the run.
        sa.Column("released_at", sa.DateTime(timezone=True)),
    )
    op.create_index(
        "kv_reservations_open",
        "kv_reservations",
        ["tenant_id"],
        postgresql_where=sa.text("released_at IS NULL"),
    )
    op.create_table(
        "ledger_entries",
        sa.Column("entry_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("run_id", sa.Text, sa.ForeignKey("runs.run_id"), nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("billing_type", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("quantity", sa.BigInteger, nullable=False),
        sa.Column("unit_price_micros", sa.BigInteger, nullable=False),
        sa.Column("amount_micros", sa.BigInteger, nullable=False),
        sa.Column("currency", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.UniqueConstraint(
            "tenant_id", "idempotency_key", "billing_type", name="ledger_entries_once"
        ),
    )
    op.create_index("ledger_entries_tenant_time", "ledger_entries", ["tenant_id", "created_at"])
    op.create_index("ledger_entries_run", "ledger_entries", ["run_id"])


def downgrade() -> None:
    op.drop_table("ledger_entries")
    op.drop_table("kv_reservations")
    op.drop_table("api_keys")
    op.drop_table("tenants")
