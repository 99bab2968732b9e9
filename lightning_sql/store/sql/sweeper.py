"""Lease expiry (docs/store-contract.md §2.15): expired attempts -> timeout/unresponsive, rollouts -> requeue or fail.

A few set-based statements in one transaction, idempotent and safe to run from many processes at
once.  On PostgreSQL the candidate rollout rows are taken ``FOR UPDATE SKIP LOCKED`` so a sweep never
waits on a busy row (it is left to the next sweep).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Integer, and_, bindparam, case, literal, or_, select, update

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.attempts import backoff_until
from lightning_sql.store.sql.executor import UnitContext
from lightning_sql.types import IN_FLIGHT_STATUSES, RolloutConfig, rollout_status_from_attempt

R = s.rollouts
A = s.attempts
W = s.workers

# An executemany UPDATE of rollouts still in flight (it cannot expand an IN list of bound values).
_UPDATE_IN_FLIGHT = update(R).where(
    R.c.run_id == bindparam("b_run"),
    R.c.rollout_id == bindparam("b_rollout"),
    or_(*(R.c.status == status for status in IN_FLIGHT_STATUSES)),
)

# Attempts re-checked and updated per statement (3 bound values each: well within driver limits).
RECHECK_CHUNK = 500


def expire_leases(ctx: UnitContext, run_id: int | None, now: float) -> int:
    """Sweep one run (or every run when ``run_id`` is None); returns the number of attempts hit."""
    now_p = literal(now, type_=s.EpochSeconds)
    timed_out = and_(R.c.timeout_seconds.isnot(None), now_p - A.c.start_time > R.c.timeout_seconds)
    silent = and_(
        R.c.unresponsive_seconds.isnot(None),
        or_(
            and_(A.c.last_heartbeat_time.isnot(None), now_p - A.c.last_heartbeat_time > R.c.unresponsive_seconds),
            and_(A.c.last_heartbeat_time.is_(None), now_p - A.c.start_time > R.c.unresponsive_seconds),
        ),
    )
    where = [
        R.c.status.in_(IN_FLIGHT_STATUSES),
        R.c.attempt_count > 0,
        or_(timed_out, silent),
    ]
    if run_id is not None:
        where.insert(0, R.c.run_id == run_id)
    stmt = (
        select(
            R.c.run_id,
            R.c.rollout_id,
            R.c.max_attempts,
            R.c.retry_condition,
            A.c.attempt_id,
            A.c.sequence_id,
            A.c.worker_id,
            timed_out.label("timed_out"),
        )
        .join(
            A,
            and_(A.c.run_id == R.c.run_id, A.c.rollout_id == R.c.rollout_id, A.c.sequence_id == R.c.attempt_count),
        )
        .where(*where)
    )
    stmt = d.for_update(ctx, stmt, skip_locked=True, of=R)
    # Sorted here, not by the statement: an ORDER BY on the primary key lets the planner walk the run
    # in key order and filter on the status, reading every rollout of the run per sweep, where the
    # (run_id, status) index reads only the ones in flight (ADR 0007; SKIP LOCKED never waits, so the
    # order the rows are locked in cannot deadlock).
    hits = sorted(ctx.execute(stmt).all(), key=lambda hit: (hit.run_id, hit.rollout_id))
    if not hits:
        return 0

    # Re-check every condition on the rows we change (§2.15): the candidate SELECT read the attempts
    # under its statement snapshot, and on PostgreSQL a heartbeat that committed after that snapshot
    # but before the rollout row was locked is visible only to a later statement.  So the UPDATE
    # itself requires the attempt to still be its in-flight rollout's latest and its limit to still be
    # exceeded, and decides timeout vs unresponsive again; only the attempts it changed move on.
    by_key = {(hit.run_id, hit.rollout_id, hit.attempt_id): hit for hit in hits}
    keys = list(by_key)
    changed: list[tuple[Any, str]] = []
    for start in range(0, len(keys), RECHECK_CHUNK):
        chunk = keys[start : start + RECHECK_CHUNK]
        rows = ctx.execute(
            update(A)
            .where(
                d.named_attempts(ctx, chunk),
                R.c.run_id == A.c.run_id,
                R.c.rollout_id == A.c.rollout_id,
                R.c.attempt_count == A.c.sequence_id,
                R.c.status.in_(IN_FLIGHT_STATUSES),
                or_(timed_out, silent),
            )
            .values(status=case((timed_out, "timeout"), else_="unresponsive"))
            .returning(A.c.run_id, A.c.rollout_id, A.c.attempt_id, A.c.status)
        ).all()
        for row in rows:
            changed.append((by_key[(row.run_id, row.rollout_id, row.attempt_id)], row.status))
    if not changed:
        return 0
    changed.sort(key=lambda item: (item[0].run_id, item[0].rollout_id))  # queue tail in rollout_id order

    requeue: dict[int, list[Any]] = defaultdict(list)
    fail: list[dict[str, Any]] = []
    workers: list[dict[str, Any]] = []
    for hit, new_attempt_status in changed:
        config = RolloutConfig.model_construct(max_attempts=hit.max_attempts, retry_condition=list(hit.retry_condition or []))
        if rollout_status_from_attempt(new_attempt_status, hit.sequence_id, config) == "requeuing":
            requeue[hit.run_id].append(hit)
        else:
            fail.append({"b_run": hit.run_id, "b_rollout": hit.rollout_id})
        if hit.worker_id:
            workers.append({"b_run": hit.run_id, "b_worker": hit.worker_id, "b_attempt": hit.attempt_id})

    requeue_params: list[dict[str, Any]] = []
    for rid_run, run_hits in requeue.items():
        positions = d.allocate_positions(ctx, rid_run, len(run_hits))
        for hit, pos in zip(run_hits, positions, strict=True):
            requeue_params.append({"b_run": hit.run_id, "b_rollout": hit.rollout_id, "b_pos": pos, "b_seq": hit.sequence_id})
        ctx.announce(rid_run, "queued")
    if requeue_params:
        not_before = backoff_until(now_p, bindparam("b_seq", type_=Integer), R)
        requeue_stmt = _UPDATE_IN_FLIGHT.values(status="requeuing", queue_seq=bindparam("b_pos"), not_before=not_before)
        ctx.execute(requeue_stmt, requeue_params)
    if fail:
        ctx.execute(_UPDATE_IN_FLIGHT.values(status="failed", end_time=now, queue_seq=None), fail)
        for run in {f["b_run"] for f in fail}:
            ctx.announce(run, "finished")
    if workers:
        ctx.execute(
            update(W)
            .where(
                W.c.run_id == bindparam("b_run"),
                W.c.worker_id == bindparam("b_worker"),
                W.c.current_attempt_id == bindparam("b_attempt"),
            )
            .values(status="unknown", last_idle_time=now, current_rollout_id=None, current_attempt_id=None),
            workers,
        )
    return len(changed)
