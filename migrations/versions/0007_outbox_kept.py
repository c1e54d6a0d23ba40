"""The outbox keeps published rows for a while, with where the broker put them, so that
events a broker acknowledged and then lost (one restarted empty, a topic gone) can be
published again from the event store.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox", sa.Column("published_at", sa.DateTime(timezone=True)))
    op.add_column("outbox", sa.Column("kafka_partition", sa.Integer))
    op.add_column("outbox", sa.Column("kafka_offset", sa.BigInteger))
    op.create_index(
        "outbox_unpublished", "outbox", ["id"], postgresql_where=sa.text("published_at IS NULL")
    )
    op.create_index(
        "outbox_published",
        "outbox",
        ["published_at"],
        postgresql_where=sa.text("published_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.execute("DELETE FROM outbox WHERE published_at IS NOT NULL")
    op.drop_index("outbox_published", "outbox")
    op.drop_index("outbox_unpublished", "outbox")
    op.drop_column("outbox", "kafka_offset")
    op.drop_column("outbox", "kafka_partition")
    op.drop_column("outbox", "published_at")
