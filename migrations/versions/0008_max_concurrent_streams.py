"""Per-tenant limit on open streams, and an index for each tenant's share of the queue.

`tenants.max_concurrent_streams`: NULL = admission's default, 0 = unlimited.
`runs_tenant_queued` finds a tenant's queued runs without reading its history.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("max_concurrent_streams", sa.Integer, nullable=True))
    op.create_index(
        "runs_tenant_queued",
        "runs",
        ["tenant_id"],
        postgresql_where=sa.text("state = 'queued'"),
    )


def downgrade() -> None:
    op.drop_index("runs_tenant_queued", table_name="runs")
    op.drop_column("tenants", "max_concurrent_streams")
