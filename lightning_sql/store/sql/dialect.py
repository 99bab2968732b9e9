"""The ONLY place where SQLite and PostgreSQL differ: upserts, row locks, positions, substring tests.

Every other module builds dialect-neutral SQLAlchemy Core and asks this module for the pieces that
cannot be neutral.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Select, Table, func, literal, select, update
from sqlalchemy.dialects import postgresql, sqlite

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.engine import UnitContext


def insert(ctx: UnitContext, table: Table) -> Any:
    """An INSERT that supports ``on_conflict_do_nothing`` / ``on_conflict_do_update`` on both dialects."""
    if ctx.dialect == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def for_update(ctx: UnitContext, stmt: Select[Any], *, skip_locked: bool = False) -> Select[Any]:
    """Lock the selected rows on PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` already serialises writers."""
    if ctx.dialect == "postgresql":
        return stmt.with_for_update(skip_locked=skip_locked)
    return stmt


def contains(ctx: UnitContext, column: Any, needle: str) -> ColumnElement[bool]:
    """Case-sensitive substring test with no LIKE metacharacters (contract §2.17)."""
    if ctx.dialect == "postgresql":
        return func.strpos(column, needle) > 0
    return func.instr(column, needle) > 0


def allocate_positions(ctx: UnitContext, run_id: int, count: int) -> list[int]:
    """``count`` increasing positions (create/touch/queue order) for the run, inside the unit.

    PostgreSQL draws them from one database-wide sequence (no lock on a per-run row, so concurrent
    writers never queue behind each other); SQLite bumps ``runs.seq`` (writers are serialised
    anyway).  Either way every run sees strictly increasing values.
    """
    if count <= 0:
        return []
    if ctx.dialect == "postgresql":
        rows = ctx.conn.execute(
            select(s.position_seq.next_value()).select_from(func.generate_series(1, count))
        ).scalars()
        return sorted(int(v) for v in rows)
    end = ctx.conn.execute(
        update(s.runs).where(s.runs.c.run_id == run_id).values(seq=s.runs.c.seq + count).returning(s.runs.c.seq)
    ).scalar_one()
    return list(range(int(end) - count + 1, int(end) + 1))


def position_expr(ctx: UnitContext, run_id: int) -> Any:
    """A SQL expression giving one fresh position, for single-row inserts/upserts."""
    if ctx.dialect == "postgresql":
        return s.position_seq.next_value()
    return literal(allocate_positions(ctx, run_id, 1)[0])


def server_epoch(ctx: UnitContext) -> Any:
    """The database server's clock in epoch seconds (only for measuring the clock offset, §0.2)."""
    return select(func.extract("epoch", func.clock_timestamp()))
