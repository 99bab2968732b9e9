"""The spans' ordering index ends with ``id``: (run_id, rollout_id, attempt_id, sequence_id, id).

``query_spans`` returns a rollout's spans by ``sequence_id``, ties in insertion order (``id``).  With
the index ending at ``sequence_id``, PostgreSQL needed a sort after it: an incremental one where its
statistics describe the trace, a full one of every span of the attempt where they do not (a table
not analysed since the trace was written), and then a page of 10 from a trace of 10,000 spans read,
converted and sorted all 10,000 (docs/adr/0010-span-pages-follow-the-index.md).  With ``id`` last
it reads the index in the page's order and stops at the page's end, whatever the statistics.  SQLite already read in that order (the rowid
ends every index entry); the index is rebuilt there too, so that both dialects hold the catalogue the
models describe.

On a large PostgreSQL database the build holds a SHARE lock on ``spans`` (span writers wait) while
it runs.  To build it without blocking writers, run before the upgrade (docs/operations.md)::

    CREATE INDEX CONCURRENTLY ix_spans_run_id_rollout_id_attempt_id_sequence_id_id
        ON <schema>.spans (run_id, rollout_id, attempt_id, sequence_id, id);

The upgrade keeps a valid index of that name and definition, drops and builds again one that is
not (a concurrent build that failed leaves an invalid index), and then drops the old index.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from lightning_sql.store.sql import views

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

# An index changes plans, never results: older code runs unchanged on either index.
compatible_with_older_code = True

OLD_INDEX = "ix_spans_run_id_rollout_id_attempt_id_sequence_id"
NEW_INDEX = "ix_spans_run_id_rollout_id_attempt_id_sequence_id_id"
OLD_COLUMNS = ["run_id", "rollout_id", "attempt_id", "sequence_id"]
NEW_COLUMNS = [*OLD_COLUMNS, "id"]

# The index of that name in the schema: whether it is valid, usable as it is (a plain index on
# spans, no predicate, no expression) and its columns in order, each marked when the index sorts it
# by another collation than the column's; no row when there is none.
_PREBUILT = sa.text(
    "SELECT i.indisvalid AND i.indisready AND NOT i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL"
    " AND t.relname = 'spans',"
    " ARRAY(SELECT a.attname::text"
    "              || CASE WHEN i.indcollation[k.position - 1] = a.attcollation THEN '' ELSE ' (collation)' END"
    "       FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, position)"
    "       JOIN pg_catalog.pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
    "       ORDER BY k.position)"
    " FROM pg_catalog.pg_index AS i"
    " JOIN pg_catalog.pg_class AS c ON c.oid = i.indexrelid"
    " JOIN pg_catalog.pg_class AS t ON t.oid = i.indrelid"
    " JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace"
    " WHERE n.nspname = :schema AND c.relname = :name"
)


def _prebuilt_index_is_usable() -> bool:
    """PostgreSQL: whether an operator built the new index beforehand (``CREATE INDEX CONCURRENTLY``)
    and it can be kept; one that cannot (invalid, or another definition) is dropped here."""
    bind = op.get_bind()
    where = views.connection_schema(bind) or bind.execute(sa.text("SELECT current_schema()")).scalar()
    found = bind.execute(_PREBUILT, {"schema": where, "name": NEW_INDEX}).first()
    if found is None:
        return False
    usable, columns = found
    if usable and list(columns) == NEW_COLUMNS:
        return True
    op.drop_index(NEW_INDEX, table_name="spans")
    return False


def upgrade() -> None:
    context = op.get_context()
    keep = context.dialect.name == "postgresql" and not context.as_sql and _prebuilt_index_is_usable()
    if not keep:
        op.create_index(NEW_INDEX, "spans", NEW_COLUMNS)
    op.drop_index(OLD_INDEX, table_name="spans")


def downgrade() -> None:
    op.create_index(OLD_INDEX, "spans", OLD_COLUMNS)
    op.drop_index(NEW_INDEX, table_name="spans")
