"""A run's reserved KV blocks are `num_kv_blocks`: the reservation column and the key in
stored `queued` payloads, as the `Queued` event's proto field.

The payload is `json`, which may hold U+0000, so it is rewritten as text rather than
through `jsonb`. The quoted key followed by a colon cannot occur inside a JSON string,
whose quotes are escaped, so the replace touches the key alone.

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _rename_queued_key(old: str, new: str) -> None:
    op.execute(
        f"""
        UPDATE run_events
        SET payload = replace(payload::text, '"{old}":', '"{new}":')::json
        WHERE kind = 'queued' AND strpos(payload::text, '"{old}":') > 0
        """
    )


def upgrade() -> None:
    op.alter_column("kv_reservations", "num_blocks", new_column_name="num_kv_blocks")
    _rename_queued_key("kv_blocks_reserved", "num_kv_blocks")


def downgrade() -> None:
    op.alter_column("kv_reservations", "num_kv_blocks", new_column_name="num_blocks")
    _rename_queued_key("num_kv_blocks", "kv_blocks_reserved")
