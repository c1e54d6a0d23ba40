"""Run attachments: which admission replica streams a run to a client, as a lease it
renews, so that a client whose stream breaks on one replica and resumes on another is not
cancelled by the first, and an admission that dies cancels its abandoned runs later (by
another replica, once the lease and the grace have run out), not never.

One row per (run, replica) that streams or streamed the run; `grace_seconds` is the run's
disconnect grace. A run is abandoned once every row's `expires_at + grace` has passed.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_attachments",
        sa.Column("run_id", sa.Text, sa.ForeignKey("runs.run_id"), primary_key=True),
        sa.Column("replica_id", sa.Text, primary_key=True),
        sa.Column("grace_seconds", sa.Float, nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("run_attachments")
