"""OpenAI's Batch API: uploaded files, batches, and each batch line's run.

A file's bytes are kept in `file_chunks`, in order, each at most a chunk's size (a
`bytea` each, so no row nears PostgreSQL's one-gigabyte field limit and a download
streams chunk by chunk). `files.endpoints` lists the `url`s a batch input's lines name,
checked against a batch's `endpoint` when the batch is created. A batch's lines are
runs: `batch_lines` names each line's run (its idempotency key names the line), or the
error that kept it from having one. `deleted_at` marks a deleted file.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSON

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("file_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("purpose", sa.Text, nullable=False),
        sa.Column("filename", sa.Text, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("lines", sa.Integer, nullable=False),
        sa.Column("endpoints", JSON, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
    )
    op.create_index("files_tenant_created", "files", ["tenant_id", "created_at"])
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.Text, primary_key=True),
        sa.Column("chunk", sa.Integer, primary_key=True),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "batches",
        sa.Column("batch_id", sa.Text, primary_key=True),
        sa.Column("tenant_id", sa.Text, nullable=False),
        sa.Column("key_id", sa.Text, nullable=False),
        sa.Column("endpoint", sa.Text, nullable=False),
        sa.Column("input_file_id", sa.Text, nullable=False),
        sa.Column("completion_window", sa.Text, nullable=False),
        sa.Column("metadata", JSON),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("output_file_id", sa.Text),
        sa.Column("error_file_id", sa.Text),
        sa.Column("errors", JSON),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("in_progress_at", sa.DateTime(timezone=True)),
        sa.Column("finalizing_at", sa.DateTime(timezone=True)),
        sa.Column("completed_at", sa.DateTime(timezone=True)),
        sa.Column("failed_at", sa.DateTime(timezone=True)),
        sa.Column("expired_at", sa.DateTime(timezone=True)),
        sa.Column("cancelling_at", sa.DateTime(timezone=True)),
        sa.Column("cancelled_at", sa.DateTime(timezone=True)),
    )
    op.create_index("batches_tenant_created", "batches", ["tenant_id", "created_at"])
    op.create_index(
        "batches_open",
        "batches",
        ["created_at"],
        postgresql_where=sa.text(
            "status IN ('validating', 'in_progress', 'finalizing', 'cancelling')"
        ),
    )
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.Text, primary_key=True),
        sa.Column("line", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Text),
        sa.Column("error", JSON),
    )


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("file_chunks")
    op.drop_table("files")
