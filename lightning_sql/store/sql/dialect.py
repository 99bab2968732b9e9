"""The ONLY place where SQLite and PostgreSQL differ: upserts, row locks, positions, substring tests.

Every other module builds dialect-neutral SQLAlchemy Core and asks this module for the pieces that
cannot be neutral.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Float,
    Integer,
    Select,
    Table,
    Text,
    bindparam,
    func,
    literal,
    select,
    update,
)
from sqlalchemy import (
    insert as core_insert,
)
from sqlalchemy.dialects import postgresql, sqlite

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.engine import UnitContext
from lightning_sql.store.sql.statements import cached


def insert(ctx: UnitContext | str, table: Table) -> Any:
    """An INSERT that supports ``on_conflict_do_nothing`` / ``on_conflict_do_update`` on both dialects."""
    dialect = ctx if isinstance(ctx, str) else ctx.dialect
    if dialect == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def next_create_seq(dialect: str, table: Table, run_id: Any) -> Any:
    """An expression giving a fresh insertion position for one new row of ``table`` in a prebuilt
    statement: the position sequence on PostgreSQL; on SQLite (writers serialised) the run's
    highest ``create_seq`` + 1, an index lookup."""
    if dialect == "postgresql":
        return s.position_seq.next_value()
    return (
        select(func.coalesce(func.max(table.c.create_seq), 0) + 1).where(table.c.run_id == run_id).scalar_subquery()
    )


def for_update(ctx: UnitContext, stmt: Select[Any], *, skip_locked: bool = False) -> Select[Any]:
    """Lock the selected rows on PostgreSQL; SQLite's ``BEGIN IMMEDIATE`` already serialises writers."""
    if ctx.dialect == "postgresql":
        return stmt.with_for_update(skip_locked=skip_locked)
    return stmt


def contains(ctx: UnitContext, column: Any, needle: Any) -> ColumnElement[bool]:
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
        rows = ctx.execute(
            select(s.position_seq.next_value()).select_from(func.generate_series(1, count))
        ).scalars()
        return sorted(int(v) for v in rows)
    end = ctx.execute(
        update(s.runs).where(s.runs.c.run_id == run_id).values(seq=s.runs.c.seq + count).returning(s.runs.c.seq)
    ).scalar_one()
    return list(range(int(end) - count + 1, int(end) + 1))


def server_epoch(ctx: UnitContext) -> Any:
    """The database server's clock in epoch seconds (only for measuring the clock offset, §0.2)."""
    return select(func.extract("epoch", func.clock_timestamp()))


def claim_in_one_statement(
    ctx: UnitContext, run_id: int, now: float, attempt_ids: Sequence[str], worker_id: str | None, returning: Sequence[Any]
) -> list[Any] | None:
    """PostgreSQL: pick, mark and attempt up to ``len(attempt_ids)`` queued rollouts in ONE round trip.

    One statement of data-modifying CTEs: the lowest ``queue_seq`` rows (``FOR UPDATE SKIP
    LOCKED``) become ``preparing`` and leave the queue, and each gets its attempt, the i-th picked
    rollout the i-th attempt id; with a (non-empty) ``worker_id`` the worker row is upserted busy on
    the last claimed attempt, as ``workers.sync_worker(..., claim=True)`` does.  Rows come back in
    queue order with the ``returning`` columns of the rollout plus ``attempt_count`` (= the attempt's
    ``sequence_id``) and ``attempt_id``.  Being one statement, it is atomic without a transaction.
    Returns None on SQLite, where writers are serialised and a statement costs no round trip: the
    caller runs the plain steps.
    """
    if ctx.dialect != "postgresql":
        return None
    columns = tuple(c.name for c in returning)
    stmt = cached(
        ("claim_one_statement", columns, bool(worker_id)),
        lambda: _claim_statement(returning, with_worker=bool(worker_id)),
    )
    params = {
        "claim_run_id": run_id,
        "claim_limit": len(attempt_ids),
        "claim_now": now,
        "claim_worker_id": worker_id,
        "claim_attempt_ids": list(attempt_ids),
    }
    return list(ctx.execute(stmt, params).all())


# The worker columns a claim sets (workers._BUSY_CLAIM); an existing row keeps every other column.
_CLAIM_WORKER_COLUMNS = ("status", "last_busy_time", "current_rollout_id", "current_attempt_id", "last_dequeue_time")


def _claim_statement(returning: Sequence[Any], *, with_worker: bool) -> Any:
    R, A = s.rollouts, s.attempts
    run_id = bindparam("claim_run_id", type_=Integer)
    picked = (
        select(R.c.rollout_id, R.c.queue_seq)
        .where(R.c.run_id == run_id, R.c.queue_seq.isnot(None))
        .order_by(R.c.queue_seq)
        .limit(bindparam("claim_limit", type_=Integer))
        .with_for_update(skip_locked=True)
        .cte("picked")
    )
    claimed = (
        update(R)
        .where(R.c.run_id == run_id, R.c.rollout_id == picked.c.rollout_id)
        .values(status="preparing", queue_seq=None, attempt_count=R.c.attempt_count + 1)
        .returning(*returning, R.c.attempt_count, picked.c.queue_seq.label("picked_seq"))
        .cte("claimed")
    )
    ranked = select(claimed, func.row_number().over(order_by=claimed.c.picked_seq).label("pos")).cte("ranked")
    ids = (
        func.unnest(bindparam("claim_attempt_ids", type_=postgresql.ARRAY(Text)))
        .table_valued("attempt_id", with_ordinality="pos")
        .render_derived(name="ids")
    )
    attempt_rows = select(
        run_id,
        ranked.c.rollout_id,
        ids.c.attempt_id,
        ranked.c.attempt_count,
        literal("preparing", Text),
        bindparam("claim_worker_id", type_=Text),
        bindparam("claim_now", type_=Float(precision=53)),
    ).select_from(ranked.join(ids, ids.c.pos == ranked.c.pos))
    inserted = (
        core_insert(A)
        .from_select(
            ["run_id", "rollout_id", "attempt_id", "sequence_id", "status", "worker_id", "start_time"], attempt_rows
        )
        .returning(A.c.rollout_id, A.c.attempt_id)
        .cte("inserted")
    )
    stmt = (
        select(ranked, inserted.c.attempt_id)
        .join_from(ranked, inserted, inserted.c.rollout_id == ranked.c.rollout_id)
        .order_by(ranked.c.pos)
    )
    if not with_worker:
        return stmt
    W = s.workers
    now = bindparam("claim_now", type_=Float(precision=53))
    last_claimed = (
        select(
            run_id,
            bindparam("claim_worker_id", type_=Text),
            s.position_seq.next_value(),
            literal("busy", Text),
            now,
            ranked.c.rollout_id,
            inserted.c.attempt_id,
            now,
        )
        .join_from(ranked, inserted, inserted.c.rollout_id == ranked.c.rollout_id)
        .order_by(ranked.c.pos.desc())
        .limit(1)
    )
    upsert = postgresql.insert(W).from_select(["run_id", "worker_id", "create_seq", *_CLAIM_WORKER_COLUMNS], last_claimed)
    upsert = upsert.on_conflict_do_update(
        index_elements=[W.c.run_id, W.c.worker_id], set_={col: upsert.excluded[col] for col in _CLAIM_WORKER_COLUMNS}
    )
    # A data-modifying CTE runs to completion whether or not the outer query reads it.
    return stmt.add_cte(upsert.returning(W.c.worker_id).cte("worker_sync"))
