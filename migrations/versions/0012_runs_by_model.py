"""An index of each tenant's runs by model, newest first.

A key scoped to some models lists only their runs (ListRuns, the console); without it
the tenant's index would walk every run of the tenant's other models to find a page.

Revision ID: 0012
Revises: 0011
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "runs_tenant_model_created", "runs", ["tenant_id", "model", "created_at", "run_id"]
    )


def downgrade() -> None:
    op.drop_index("runs_tenant_model_created", table_name="runs")
