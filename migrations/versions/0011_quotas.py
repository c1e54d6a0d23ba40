"""Rate limits, token limits and spend budgets, per tenant and per API key.

`tenants` gains the tenant's limits (0 = unlimited); `key_quotas` holds a key's own,
of which the tighter of the two wins. Each run's reservation row now also holds what
the rate and budget limits count: its key, its input and output tokens and its spend
(reserved at admission for the worst case, settled to the actual usage at billing),
and the budget periods it was charged to. `budget_spend` keeps each subject's spend
in each period, so a monthly budget costs one row, not a month of reservations.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

RATE_COLUMNS = (
    ("requests_per_minute", sa.Integer),
    ("input_tokens_per_minute", sa.BigInteger),
    ("output_tokens_per_minute", sa.BigInteger),
    ("budget_micros", sa.BigInteger),
)


def _limit_columns() -> list[sa.Column]:  # type: ignore[type-arg]
    columns = [
        sa.Column(name, kind, nullable=False, server_default="0") for name, kind in RATE_COLUMNS
    ]
    columns.append(sa.Column("budget_period", sa.Text, nullable=False, server_default="month"))
    return columns


def upgrade() -> None:
    for column in _limit_columns():
        op.add_column("tenants", column)
    op.create_table(
        "key_quotas",
        sa.Column("key_id", sa.Text, sa.ForeignKey("api_keys.key_id"), primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        *_limit_columns(),
        sa.Column("max_concurrent_runs", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_kv_blocks", sa.BigInteger, nullable=False, server_default="0"),
    )
    for name in ("input_tokens", "output_tokens", "spend_micros"):
        op.add_column(
            "kv_reservations", sa.Column(name, sa.BigInteger, nullable=False, server_default="0")
        )
    op.add_column(
        "kv_reservations", sa.Column("key_id", sa.Text, nullable=False, server_default="")
    )
    # The budget periods this run's spend was charged to; NULL: no budget charged.
    op.add_column("kv_reservations", sa.Column("tenant_budget_start", sa.DateTime(timezone=True)))
    op.add_column("kv_reservations", sa.Column("key_budget_start", sa.DateTime(timezone=True)))
    # The last minute of a tenant's (a key's) admissions, read without the table.
    op.create_index(
        "kv_reservations_tenant_window",
        "kv_reservations",
        ["tenant_id", "reserved_at"],
        postgresql_include=["input_tokens", "output_tokens"],
    )
    op.create_index(
        "kv_reservations_key_window",
        "kv_reservations",
        ["key_id", "reserved_at"],
        postgresql_include=["input_tokens", "output_tokens", "num_kv_blocks", "released_at"],
        postgresql_where=sa.text("key_id <> ''"),
    )
    op.create_table(
        "budget_spend",
        sa.Column("subject", sa.Text, primary_key=True),  # tenant:<id> | key:<id>
        sa.Column("period_start", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("spent_micros", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("budget_spend")
    op.drop_index("kv_reservations_key_window", table_name="kv_reservations")
    op.drop_index("kv_reservations_tenant_window", table_name="kv_reservations")
    for name in (
        "key_budget_start",
        "tenant_budget_start",
        "key_id",
        "spend_micros",
        "output_tokens",
        "input_tokens",
    ):
        op.drop_column("kv_reservations", name)
    op.drop_table("key_quotas")
    for name in ("budget_period", *(name for name, _ in reversed(RATE_COLUMNS))):
        op.drop_column("tenants", name)
