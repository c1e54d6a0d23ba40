"""What a Responses API response holds beyond its run's events.

A response is a run: its id is the run's, spelled `resp_` for `run_`. Its row keeps what
the events do not: the input items as sent, the conversation the run was given (without
its instructions, which a later turn does not inherit), and the request's fields that the
Response object echoes (`instructions`, `metadata`, `store`, `background`,
`previous_response_id`, `temperature`, `text`, `tools`, ...). `deleted_at` marks a
deleted response. The JSON columns are `json`, not `jsonb`: text may contain U+0000.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSON

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("run_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("request", JSON, nullable=False),
        sa.Column("input_items", JSON, nullable=False),
        sa.Column("conversation", JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
    )
    op.create_index("responses_tenant_created", "responses", ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_table("responses")
