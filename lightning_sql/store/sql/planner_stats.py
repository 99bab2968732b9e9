"""Planner statistics for the run tables on PostgreSQL: ``ANALYZE`` a table once it has changed by
as many rows as it held when it was last analysed (ADR 0006).

Without statistics PostgreSQL takes ``run_id = <the run>`` to match a few rows whatever the table
holds, and a prepared statement keeps the plan made from that belief for the connection's life: a
claim, a span batch, a lock on one rollout then scan every row of the run, and each call costs more
as the run grows.  Autovacuum analyses a table after
changes of 10% of it, once a minute, when it is on; this does the same for the tables a store
writes, from the lazy sweep, when a table has changed by as many rows as it held at its last
analysis (1,000 at least), so a table is analysed O(log n) times while it grows to n rows.
``ANALYZE`` also invalidates every connection's cached plans of these tables, so the next
execution of each statement is planned with the new statistics.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, text

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import UnitContext

# A table is analysed once it has changed by max(MIN_CHANGES, rows at the last analysis) rows.
MIN_CHANGES = 1000
# The tables whose plans depend on how many rows a run holds, and the columns analysed (None: all).
# The spans' JSON columns are left out: no statement of the store filters on them, and sampling them
# is most of an ANALYZE's cost.
RUN_TABLES: dict[str, tuple[str, ...] | None] = {
    "attempts": None,
    "rollouts": None,
    "spans": tuple(c.name for c in s.spans.c if not isinstance(c.type, s.JsonValue)),
}

_DUE = text(
    """
    SELECT c.relname AS name
    FROM pg_catalog.pg_class AS c
    JOIN pg_catalog.pg_stat_user_tables AS t ON t.relid = c.oid
    WHERE c.relnamespace = to_regnamespace(:schema)
      AND c.relname = ANY(:tables)
      AND pg_catalog.pg_has_role(c.relowner, 'USAGE')
      AND t.n_mod_since_analyze >= greatest(:min_changes, c.reltuples)
    ORDER BY c.relname
    """
)


def analyze_changed_tables(ctx: UnitContext, schema: str) -> list[str]:
    """``ANALYZE`` the run tables of ``schema`` that changed enough since their last analysis (see the
    module's docstring); the names of those analysed.  Tables this role does not own are left to
    their owner and autovacuum.  One store at a time per schema (a transaction-scoped advisory lock);
    the others skip."""
    preparer = ctx.conn.dialect.identifier_preparer
    found = {
        row.name
        for row in ctx.conn.execute(
            _DUE,
            {"schema": preparer.quote_schema(schema), "tables": list(RUN_TABLES), "min_changes": MIN_CHANGES},
        )
    }
    due = [name for name in RUN_TABLES if name in found]  # names from this module, not the database
    if not due:
        return []
    lock = func.pg_try_advisory_xact_lock(func.hashtext(f"lightning_sql.analyze:{schema}"))
    if not ctx.conn.execute(select(lock)).scalar():
        return []
    tables = ", ".join(_target(preparer, schema, name) for name in due)
    ctx.conn.execute(text(f"ANALYZE {tables}"))
    return due


def _target(preparer: Any, schema: str, name: str) -> str:
    """``schema.table`` or ``schema.table (columns)`` for ANALYZE, every name quoted."""
    columns = RUN_TABLES[name]
    table = f"{preparer.quote_schema(schema)}.{preparer.quote(name)}"
    return table if columns is None else f"{table} ({', '.join(preparer.quote(c) for c in columns)})"
