"""Claims: queued rollouts picked in queue order, each with a fresh ``preparing`` attempt.

PostgreSQL claims in one statement (``dialect.claim_in_one_statement``: ``FOR UPDATE SKIP LOCKED``,
the attempts and the worker row in data-modifying CTEs); SQLite, whose writers are serialised by
``BEGIN IMMEDIATE``, picks, marks and inserts in three statements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, bindparam, select, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql.executor import UnitContext
from lightning_sql.store.sql.rollouts import A, R, attempt_row, fetch_rollouts, preparing_attempt
from lightning_sql.store.sql.rows import (
    ROLLOUT_COLUMNS,
    attempt_from_row,
    attempted,
)
from lightning_sql.store.sql.statements import cached
from lightning_sql.store.sql.workers import idle_on_empty_queue, sync_worker
from lightning_sql.types import AttemptedRollout


def claim(
    ctx: UnitContext, run_id: int, now: float, attempt_ids: Sequence[str], worker_id: str | None
) -> list[AttemptedRollout]:
    """Claim up to ``len(attempt_ids)`` queued rollouts in queue order (see the module docstring).
    Only a replay can find its own attempts (their ids are fresh per call): the first try skips
    that look-up."""
    limit = len(attempt_ids)
    out: list[AttemptedRollout] = []
    synced = False  # the claim statement itself synced the worker (PostgreSQL)
    if limit > 0:
        out = _replayed_claim(ctx, run_id, attempt_ids) if ctx.attempt > 0 else []
        if not out:
            out, synced = _claim_fresh(ctx, run_id, now, attempt_ids, worker_id)
    write = None if out and synced else _worker_write(ctx, run_id, now, worker_id, out)
    if write is not None:
        write.execute(ctx)
    return out


def _worker_write(
    ctx: UnitContext, run_id: int, now: float, worker_id: str | None, claimed: list[AttemptedRollout]
) -> d.Write | None:
    """The write of a claim to its worker's row: busy on the last rollout claimed, or idle when none."""
    if claimed and worker_id:  # upstream's worker sync skips a falsy id...
        last = claimed[-1]
        rid, aid = last.rollout_id, last.attempt.attempt_id
        return sync_worker(ctx, run_id, now, worker_id, "preparing", rid, aid, claim=True)
    if not claimed and worker_id is not None:  # ...but its empty-queue idle marking does not
        return idle_on_empty_queue(ctx, run_id, now, worker_id)
    return None


def _claim_sqlite(
    ctx: UnitContext, run_id: int, now: float, attempt_ids: Sequence[str], worker_id: str | None
) -> list[AttemptedRollout]:
    """SQLite (writers serialised, no locks): the claimed rollouts and their attempts, without the
    worker row: one rollout is picked and marked by one statement, several by a pick and a mark;
    their attempts are one insert."""
    if len(attempt_ids) == 1:
        rows = ctx.execute(cached(("claim_next", ctx.dialect), _claim_next), {"c_run_id": run_id}).all()
        ids = [row.rollout_id for row in rows]
    else:
        ids, rows = _pick_and_mark(ctx, run_id, len(attempt_ids))
    by_id = {row.rollout_id: row for row in rows}
    claimed = []
    attempt_rows = []
    for aid, rid in zip(attempt_ids, ids, strict=False):  # the queue may hold fewer rollouts than ids
        row = by_id[rid]
        attempt_rows.append(attempt_row(run_id, rid, aid, row.attempt_count, worker_id, now))
        claimed.append(_attempted_claim(row, aid, now, worker_id))
    if attempt_rows:
        ctx.execute(cached("attempt_insert", A.insert), attempt_rows)
    return claimed


def _replayed_claim(ctx: UnitContext, run_id: int, attempt_ids: Sequence[str]) -> list[AttemptedRollout]:
    rows = ctx.execute(
        select(A).where(A.c.run_id == run_id, A.c.attempt_id.in_(list(attempt_ids)))
    ).all()
    if not rows:
        return []
    attempts = {row.rollout_id: attempt_from_row(row) for row in rows}
    order = {aid: i for i, aid in enumerate(attempt_ids)}
    result = []
    for row in fetch_rollouts(ctx, run_id, R.c.rollout_id.in_(sorted(attempts))):
        ar = attempted(row, attempts[row.rollout_id])
        assert isinstance(ar, AttemptedRollout)
        result.append(ar)
    result.sort(key=lambda ar: order[ar.attempt.attempt_id])
    return result


def _claim_fresh(
    ctx: UnitContext, run_id: int, now: float, attempt_ids: Sequence[str], worker_id: str | None
) -> tuple[list[AttemptedRollout], bool]:
    """The claimed rollouts, and whether the worker row was synced with them."""
    one_trip = d.claim_in_one_statement(ctx, run_id, now, attempt_ids, worker_id, ROLLOUT_COLUMNS)
    if one_trip is not None:
        return [_attempted_claim(row, row.attempt_id, now, worker_id) for row in one_trip], True
    return _claim_sqlite(ctx, run_id, now, attempt_ids, worker_id), False


def _claim_next() -> Any:
    """Mark the first rollout of the queue claimed (SQLite: writers are serialised, no lock needed)."""
    queued = R.alias("queued")
    first = (
        select(queued.c.rollout_id)
        .where(queued.c.run_id == bindparam("c_run_id"), queued.c.queue_seq.isnot(None))
        .order_by(queued.c.queue_seq)
        .limit(1)
        .scalar_subquery()
    )
    return _mark_claimed(R.c.rollout_id == first)


def _mark_claimed(which: ColumnElement[bool]) -> Any:
    """UPDATE the run's rollouts ``which`` to claimed (``preparing``, out of the queue, one more
    attempt), returning their rows with ``attempt_count``."""
    return (
        update(R)
        .where(R.c.run_id == bindparam("c_run_id"), which)
        .values(status="preparing", queue_seq=None, attempt_count=R.c.attempt_count + 1)
        .returning(*ROLLOUT_COLUMNS, R.c.attempt_count)
    )


def _pick_and_mark(ctx: UnitContext, run_id: int, limit: int) -> tuple[list[str], list[Any]]:
    """The ids of up to ``limit`` queued rollouts in queue order, and their rows once marked claimed."""
    picked = cached(
        ("claim_pick", ctx.dialect),
        lambda: d.for_update(
            ctx,
            select(R.c.rollout_id)
            .where(R.c.run_id == bindparam("c_run_id"), R.c.queue_seq.isnot(None))
            .order_by(R.c.queue_seq)
            .limit(bindparam("c_limit")),
            skip_locked=True,
        ),
    )
    ids = [row[0] for row in ctx.execute(picked, {"c_run_id": run_id, "c_limit": limit})]
    if not ids:
        return [], []
    # One claimed row compares with = : an expanding IN is compiled again per call.
    single = len(ids) == 1
    mark = cached(
        ("claim_mark", single),
        lambda: _mark_claimed(
            R.c.rollout_id == bindparam("c_id") if single else R.c.rollout_id.in_(bindparam("c_ids", expanding=True))
        ),
    )
    params: dict[str, Any] = {"c_run_id": run_id}
    if single:
        params["c_id"] = ids[0]
    else:
        params["c_ids"] = ids
    return ids, ctx.execute(mark, params).all()


def _attempted_claim(row: Any, attempt_id: str, now: float, worker_id: str | None) -> AttemptedRollout:
    """The claimed rollout (a row with ``attempt_count``) with its fresh ``preparing`` attempt."""
    ar = attempted(row, preparing_attempt(row.rollout_id, attempt_id, row.attempt_count, worker_id, now))
    assert isinstance(ar, AttemptedRollout)
    return ar


