"""Run event payloads as `json`: generated text may hold U+0000, which `jsonb` rejects.

Revision ID: 0003
Revises: 0002
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE run_events ALTER COLUMN payload TYPE json USING payload::json")


def downgrade() -> None:
    op.execute("ALTER TABLE run_events ALTER COLUMN payload TYPE jsonb USING payload::jsonb")
