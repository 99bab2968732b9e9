"""Units of work for workers (contract §2.14): heartbeats, worker sync from attempts, reads."""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, case, select

from lightning_sql.store.sql import dialect as d
from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.engine import EncodedJson, UnitContext
from lightning_sql.store.sql.rows import worker_from_row
from lightning_sql.store.sql.statements import cached
from lightning_sql.types import Worker

W = s.workers


def _upsert_statement(dialect: str, insert_cols: tuple[str, ...], update_set: tuple[tuple[str, Any], ...]) -> Any:
    """INSERT ... ON CONFLICT (run_id, worker_id) DO UPDATE, with ``w_<col>`` placeholders."""
    run_id: Any = bindparam("w_run_id")
    stmt = d.insert(dialect, W).values(
        run_id=run_id,
        worker_id=bindparam("w_worker_id"),
        create_seq=d.next_create_seq(dialect, W, run_id),
        **{col: bindparam(f"w_{col}") for col in insert_cols},
    )
    excluded = stmt.excluded
    set_ = {col: (excluded[col] if how == "excluded" else how(excluded)) for col, how in update_set}
    return stmt.on_conflict_do_update(index_elements=[W.c.run_id, W.c.worker_id], set_=set_)


def _upsert(
    ctx: UnitContext,
    run_id: int,
    worker_id: str,
    insert_values: dict[str, Any],
    update_set: tuple[tuple[str, Any], ...],
) -> d.Write:
    """Creating the worker row, or updating only the columns of ``update_set`` (a prebuilt statement)."""
    insert_cols = tuple(insert_values)
    dialect = ctx.dialect
    params = {f"w_{col}": value for col, value in insert_values.items()}
    params["w_run_id"] = run_id
    params["w_worker_id"] = worker_id
    return d.Write(
        ("worker_upsert", dialect, insert_cols, update_set),
        lambda: _upsert_statement(dialect, insert_cols, update_set),
        params,
    )


def _take(*cols: str) -> tuple[tuple[str, Any], ...]:
    return tuple((col, "excluded") for col in cols)


_BUSY = _take("status", "last_busy_time", "current_rollout_id", "current_attempt_id")
_BUSY_CLAIM = _take("status", "last_busy_time", "current_rollout_id", "current_attempt_id", "last_dequeue_time")
_DONE = _take("status", "last_idle_time", "current_rollout_id", "current_attempt_id")
_HEARTBEAT = _take("last_heartbeat_time")
_HEARTBEAT_STATS = _take("last_heartbeat_time", "heartbeat_stats")


def _idle_time_unless_idle(excluded: Any) -> Any:
    # An already idle worker keeps its last_idle_time (contract §2.4).
    return case((W.c.status == "idle", W.c.last_idle_time), else_=excluded.last_idle_time)


_IDLE_ON_EMPTY = (
    ("last_dequeue_time", "excluded"),
    ("last_idle_time", _idle_time_unless_idle),
    ("status", "excluded"),
)


def idle_on_empty_queue(ctx: UnitContext, run_id: int, now: float, worker_id: str) -> d.Write:
    """A worker that found nothing to claim: idle (unless already idle), ``last_dequeue_time = now``
    (a write: run it with ``.execute(ctx)``, or with others)."""
    values = {"status": "idle", "last_idle_time": now, "last_dequeue_time": now}
    return _upsert(ctx, run_id, worker_id, values, _IDLE_ON_EMPTY)


def sync_worker(
    ctx: UnitContext,
    run_id: int,
    now: float,
    worker_id: str,
    attempt_status: str,
    rollout_id: str,
    attempt_id: str,
    *,
    claim: bool,
) -> d.Write:
    """Making the worker row follow an attempt it runs (writes only the listed fields; an upsert): run
    it with ``.execute(ctx)``, or with other writes (``dialect.run_writes``)."""
    if attempt_status in ("succeeded", "failed"):
        values: dict[str, Any] = {
            "status": "idle",
            "last_idle_time": now,
            "current_rollout_id": None,
            "current_attempt_id": None,
        }
        update_set = _DONE
    elif attempt_status in ("timeout", "unresponsive"):
        values = {"status": "unknown", "last_idle_time": now, "current_rollout_id": None, "current_attempt_id": None}
        update_set = _DONE
    else:
        values = {
            "status": "busy",
            "last_busy_time": now,
            "current_rollout_id": rollout_id,
            "current_attempt_id": attempt_id,
        }
        update_set = _BUSY
        if claim:
            values["last_dequeue_time"] = now
            update_set = _BUSY_CLAIM
    return _upsert(ctx, run_id, worker_id, values, update_set)


def update_worker(
    ctx: UnitContext, run_id: int, now: float, worker_id: str, stats: EncodedJson | None, stats_given: bool
) -> Worker:
    values: dict[str, Any] = {"status": "unknown", "last_heartbeat_time": now}
    if stats_given:
        values["heartbeat_stats"] = stats
    _upsert(ctx, run_id, worker_id, values, _HEARTBEAT_STATS if stats_given else _HEARTBEAT).execute(ctx)
    worker = get_worker(ctx, run_id, worker_id)
    assert worker is not None
    return worker


def get_worker(ctx: UnitContext, run_id: int, worker_id: str) -> Worker | None:
    stmt = cached(
        "worker_by_id",
        lambda: select(W).where(W.c.run_id == bindparam("w_run_id"), W.c.worker_id == bindparam("w_worker_id")),
    )
    row = ctx.execute(stmt, {"w_run_id": run_id, "w_worker_id": worker_id}).first()
    return worker_from_row(row) if row is not None else None
