"""SQLAlchemy Core tables for the queries built with SQLAlchemy.

The event append and the consumer tracking rows use plain SQL (event_store.py,
consumer.py): they are the hot paths.

The schema itself changes only through the Alembic migrations in migrations/.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSON, JSONB

metadata = sa.MetaData()

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("run_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("priority", sa.Text, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("owner", sa.Text),
    sa.Column("lease_epoch", sa.BigInteger, nullable=False),
    sa.Column("idempotency_key", sa.Text),
    sa.Column("request_hash", sa.Text),
    sa.Column("finish_reason", sa.Text),
    sa.Column("usage", JSONB, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)

run_events = sa.Table(
    "run_events",
    metadata,
    sa.Column("run_id", sa.Text, primary_key=True),
    sa.Column("seq", sa.BigInteger, primary_key=True),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("tenant_id", sa.Text, nullable=False),
    # `json`, not `jsonb`: generated text may contain U+0000.
    sa.Column("payload", JSON, nullable=False),
    sa.Column("traceparent", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

outbox = sa.Table(
    "outbox",
    metadata,
    sa.Column("id", sa.BigInteger, primary_key=True),
    # A row names a run event (run_id, seq) or an admin event, never both.
    sa.Column("run_id", sa.Text),
    sa.Column("seq", sa.BigInteger),
    sa.Column("admin_event_id", sa.Text),
    # Set once published; the row is kept for the relay's republish window.
    sa.Column("published_at", sa.DateTime(timezone=True)),
    sa.Column("kafka_partition", sa.Integer),
    sa.Column("kafka_offset", sa.BigInteger),
)

tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("tenant_id", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("weight", sa.Integer, nullable=False),
    sa.Column("max_kv_blocks", sa.BigInteger, nullable=False),
    sa.Column("max_concurrent_runs", sa.Integer, nullable=False),
    sa.Column("max_concurrent_streams", sa.Integer),  # NULL: admission's default
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("requests_per_minute", sa.Integer, nullable=False),
    sa.Column("input_tokens_per_minute", sa.BigInteger, nullable=False),
    sa.Column("output_tokens_per_minute", sa.BigInteger, nullable=False),
    sa.Column("budget_micros", sa.BigInteger, nullable=False),
    sa.Column("budget_period", sa.Text, nullable=False),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("key_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("secret_hash", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True)),
    sa.Column("alias", sa.Text, nullable=False),
    sa.Column("allowed_models", ARRAY(sa.Text)),  # NULL: every model
    sa.Column("expires_at", sa.DateTime(timezone=True)),
    sa.Column("last_used_at", sa.DateTime(timezone=True)),
    # The secret the last rotation replaced, and until when it still works.
    sa.Column("previous_secret_hash", sa.Text),
    sa.Column("previous_secret_expires_at", sa.DateTime(timezone=True)),
)

admin_events = sa.Table(
    "admin_events",
    metadata,
    sa.Column("event_id", sa.Text, primary_key=True),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("subject", sa.Text, nullable=False),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("before", JSONB),
    sa.Column("after", JSONB),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)

kv_reservations = sa.Table(
    "kv_reservations",
    metadata,
    sa.Column("run_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("num_kv_blocks", sa.BigInteger, nullable=False),
    sa.Column("reserved_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("released_at", sa.DateTime(timezone=True)),
    # What the rate and budget limits count: reserved at admission, settled at billing.
    sa.Column("key_id", sa.Text, nullable=False),
    sa.Column("input_tokens", sa.BigInteger, nullable=False),
    sa.Column("output_tokens", sa.BigInteger, nullable=False),
    sa.Column("spend_micros", sa.BigInteger, nullable=False),
    sa.Column("tenant_budget_start", sa.DateTime(timezone=True)),
    sa.Column("key_budget_start", sa.DateTime(timezone=True)),
)

# A key's own limits; the tighter of these and its tenant's wins.
key_quotas = sa.Table(
    "key_quotas",
    metadata,
    sa.Column("key_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("requests_per_minute", sa.Integer, nullable=False),
    sa.Column("input_tokens_per_minute", sa.BigInteger, nullable=False),
    sa.Column("output_tokens_per_minute", sa.BigInteger, nullable=False),
    sa.Column("budget_micros", sa.BigInteger, nullable=False),
    sa.Column("budget_period", sa.Text, nullable=False),
    sa.Column("max_concurrent_runs", sa.Integer, nullable=False),
    sa.Column("max_kv_blocks", sa.BigInteger, nullable=False),
)

budget_spend = sa.Table(
    "budget_spend",
    metadata,
    sa.Column("subject", sa.Text, primary_key=True),
    sa.Column("period_start", sa.DateTime(timezone=True), primary_key=True),
    sa.Column("spent_micros", sa.BigInteger, nullable=False),
)

ledger_entries = sa.Table(
    "ledger_entries",
    metadata,
    sa.Column("entry_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("run_id", sa.Text, nullable=False),
    sa.Column("idempotency_key", sa.Text, nullable=False),
    sa.Column("billing_type", sa.Text, nullable=False),
    sa.Column("model", sa.Text, nullable=False),
    sa.Column("quantity", sa.BigInteger, nullable=False),
    sa.Column("unit_price_micros", sa.BigInteger, nullable=False),
    sa.Column("amount_micros", sa.BigInteger, nullable=False),
    sa.Column("currency", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("discount_micros", sa.BigInteger, nullable=False, server_default="0"),
)

responses = sa.Table(
    "responses",
    metadata,
    sa.Column("run_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("request", JSON, nullable=False),
    sa.Column("input_items", JSON, nullable=False),
    sa.Column("conversation", JSON, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("deleted_at", sa.DateTime(timezone=True)),
)

files = sa.Table(
    "files",
    metadata,
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

file_chunks = sa.Table(
    "file_chunks",
    metadata,
    sa.Column("file_id", sa.Text, primary_key=True),
    sa.Column("chunk", sa.Integer, primary_key=True),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

batches = sa.Table(
    "batches",
    metadata,
    sa.Column("batch_id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("key_id", sa.Text, nullable=False),
    sa.Column("endpoint", sa.Text, nullable=False),
    sa.Column("input_file_id", sa.Text, nullable=False),
    sa.Column("completion_window", sa.Text, nullable=False),
    sa.Column("metadata", JSON(none_as_null=True)),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("total", sa.Integer, nullable=False),
    sa.Column("output_file_id", sa.Text),
    sa.Column("error_file_id", sa.Text),
    sa.Column("errors", JSON(none_as_null=True)),
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

batch_lines = sa.Table(
    "batch_lines",
    metadata,
    sa.Column("batch_id", sa.Text, primary_key=True),
    sa.Column("line", sa.Integer, primary_key=True),
    sa.Column("run_id", sa.Text),
    sa.Column("error", JSON(none_as_null=True)),
)
