"""PostgreSQL: ANALYZE never samples ``run_id`` (nor ``rollouts.queue_seq``) (ADR 0007).

A sample of ``run_id`` describes the runs that existed when it was taken: the planner then takes a
run created later for an empty one and reads its rows through any index that starts with ``run_id``
where a key look-up was meant, so each call of the new run costs more as the run grows.  A
statistics target of 0 keeps ANALYZE (the store's, autovacuum's, an operator's) from sampling the
column, but it does not clear what the column already holds, and frozen, those statistics would
mislead for ever.  So, per column:

* no statistics yet (a new database, or tables never analysed): its target is set to 0;
* statistics, and the migrating role is a superuser: they are deleted from ``pg_statistic`` (the
  only way to clear a column's statistics in place; only superusers write that catalogue), and the
  target is set to 0;
* statistics, and no superuser: the column is left sampled, as before this revision, and a warning
  gives the two statements a superuser runs to finish the job (docs/operations.md, "Planner
  statistics").

Nothing is rewritten or rebuilt, and no data changes.  SQLite: nothing to do (the store never runs
ANALYZE there).  The columns are spelled out here, not read from ``schema.UNSAMPLED_COLUMNS``, so
that this revision does the same whatever later revisions change.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op

from lightning_sql.store.sql import schema, views

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None

# Additive: statistics targets change plans, never results; older code runs unchanged.
compatible_with_older_code = True

logger = logging.getLogger("lightning_sql.migrations")

UNSAMPLED = {
    "attempts": ("run_id",),
    "rollouts": ("run_id", "queue_seq"),
    "spans": ("run_id",),
    "workers": ("run_id",),
}

_HAS_STATISTICS = sa.text(
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_stats"
    " WHERE schemaname = :schema AND tablename = :table AND attname = :column)"
)
_IS_SUPERUSER = sa.text("SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user")
_DELETE_STATISTICS = sa.text(
    "DELETE FROM pg_catalog.pg_statistic AS st USING pg_catalog.pg_attribute AS att"
    " WHERE st.starelid = to_regclass(quote_ident(:schema) || '.' || quote_ident(:table))"
    " AND att.attrelid = st.starelid AND att.attnum = st.staattnum AND att.attname = :column"
)


def upgrade() -> None:
    context = op.get_context()
    if context.dialect.name != "postgresql":
        return
    if context.as_sql:  # offline (--sql): the script cannot look at the statistics; targets only
        for name, columns in UNSAMPLED.items():
            for column in columns:
                op.execute(schema.SetStatisticsTarget(schema.metadata.tables[name], column, 0))
        return
    bind = op.get_bind()
    where = views.connection_schema(bind) or bind.execute(sa.text("SELECT current_schema()")).scalar()
    superuser = bool(bind.execute(_IS_SUPERUSER).scalar())
    for name, columns in UNSAMPLED.items():
        for column in columns:
            key = {"schema": where, "table": name, "column": column}
            if bind.execute(_HAS_STATISTICS, key).scalar():
                if not superuser:
                    preparer = bind.dialect.identifier_preparer
                    table = f"{preparer.quote_schema(where)}.{preparer.quote(name)}"
                    logger.warning(
                        "%s.%s keeps the statistics of its last ANALYZE, which a role that is not a superuser "
                        "cannot clear; a superuser finishes revision 0003 with: DELETE FROM pg_statistic WHERE "
                        "starelid = '%s'::regclass AND staattnum = (SELECT attnum FROM pg_attribute WHERE "
                        "attrelid = '%s'::regclass AND attname = '%s'); ALTER TABLE %s ALTER COLUMN %s "
                        "SET STATISTICS 0",
                        *(table, column, table, table, column, table, preparer.quote(column)),
                    )
                    continue
                bind.execute(_DELETE_STATISTICS, key)
            op.execute(schema.SetStatisticsTarget(schema.metadata.tables[name], column, 0))


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for name, columns in UNSAMPLED.items():
        for column in columns:
            op.execute(schema.SetStatisticsTarget(schema.metadata.tables[name], column, -1))
