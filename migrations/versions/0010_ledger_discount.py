"""What a ledger entry was let off the list price: the batch discount.

`ledger_entries.discount_micros`: amount_micros = quantity × unit_price_micros −
discount_micros; 0 for every entry written before, which paid the list price.

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "ledger_entries",
        sa.Column("discount_micros", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("ledger_entries", "discount_micros")
