"""Dead letters: run events the outbox relay set aside because the producer, the broker
or the encoder refuses them (too large, not encodable), so that the others go on.

A row names the event (it stays in `run_events`) and why it was refused. Putting it
back in the outbox (`INSERT INTO outbox (run_id, seq) SELECT run_id, seq FROM dead_letters`)
has the relay try it again.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("run_id", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("error", sa.Text, nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("clock_timestamp()"),
        ),
        sa.ForeignKeyConstraint(["run_id", "seq"], ["run_events.run_id", "run_events.seq"]),
    )
    op.create_index("dead_letters_run", "dead_letters", ["run_id", "seq"])


def downgrade() -> None:
    op.drop_table("dead_letters")
